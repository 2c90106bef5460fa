"""Prefill -> decode notices over HTTP (protocol/messages.py HandoffNotice), sent from the
handoff's notifier threads, never from the engine thread. One keep-alive client per
thread: each decode instance has its own notifier thread (transfer/sender.py)."""

from __future__ import annotations

import threading

import httpx
import msgspec

from protocol.internal_auth import auth_headers
from protocol.messages import HandoffNotice

NOTIFY_TIMEOUT_S = 30.0
"""Decode answers a SegmentsLanded after scattering it (one engine step at most)."""


class HttpNotifier:
    """POSTs a notice to decode's notify URL with the cluster secret: True on 200, False
    on 410 (the request is gone there); raises httpx.HTTPError when decode cannot be
    reached or refuses the notice. Thread-safe."""

    def __init__(self, secret: str, timeout_s: float = NOTIFY_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s
        self._headers = {"content-type": "application/json", **auth_headers(secret)}
        self._local = threading.local()

    def _client(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(timeout=self._timeout_s, trust_env=False)
            self._local.client = client
        return client

    def __call__(self, url: str, notice: HandoffNotice) -> bool:
        resp = self._client().post(
            url,
            content=msgspec.json.encode(notice),
            headers=self._headers,
        )
        if resp.status_code == 200:
            return True
        if resp.status_code in (404, 410):
            return False
        raise httpx.HTTPStatusError(
            f"decode answered {resp.status_code}: {resp.text[:200]}",
            request=resp.request,
            response=resp,
        )
