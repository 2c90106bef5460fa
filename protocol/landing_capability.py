"""Landing capabilities: a LandingInfo is written into only if the decode instance that
owns the buffer minted it for that request.

    decode /decode: region reserved ─▶ mint(key, request_id, info, expiry) per rank
                                       (info.capability = HMAC-SHA256 over the request id
                                       and every other field of the LandingInfo)
    prefill /prefill: verify(key, request_id, info, now) for every rank BEFORE the
                      request enters the engine (no byte is written otherwise)
    decode /kv_notify: every landed segment lies inside the region it reserved for that
                       request (decode_worker/landing_check.py), BEFORE any scatter

The key is derived from the cluster secret (protocol/internal_auth.py), so only a
process holding it can mint; a caller holding the secret can still only replay the
landing decode gave it for that very request id, unaltered and unexpired. Expiry is
wall-clock (Unix) time: hosts of a cluster keep their clocks in step (NTP); the margin
decode adds covers the skew.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from protocol.messages import LandingInfo

_DOMAIN = b"kvserve landing capability v1\0"


class LandingCapabilityError(ValueError):
    """A LandingInfo that the decode instance did not mint for this request, was altered,
    or has expired. Prefill refuses the request (403) and writes nothing."""


def capability_key(cluster_secret: str) -> bytes:
    """The HMAC key of landing capabilities (distinct from the bearer secret itself)."""
    return hmac.new(cluster_secret.encode(), b"landing-capability", hashlib.sha256).digest()


def _mac(key: bytes, request_id: str, info: LandingInfo) -> str:
    body = msgspec.json.encode(msgspec.structs.replace(info, capability=""))
    return hmac.new(key, _DOMAIN + request_id.encode() + b"\0" + body, hashlib.sha256).hexdigest()


def mint(key: bytes, request_id: str, info: LandingInfo, expires_at_s: float) -> LandingInfo:
    """`info` for `request_id`, valid until `expires_at_s` (Unix time)."""
    info = msgspec.structs.replace(info, expires_at_s=round(expires_at_s, 3), capability="")
    return msgspec.structs.replace(info, capability=_mac(key, request_id, info))


def verify(key: bytes, request_id: str, info: LandingInfo, now_s: float) -> None:
    """Raise LandingCapabilityError unless `info` is exactly what decode minted for
    `request_id` and has not expired."""
    if not info.capability:
        raise LandingCapabilityError(
            f"the landing of decode rank {info.rank} carries no capability: only a "
            "landing a decode instance returned in DecodeReady can be written"
        )
    if not hmac.compare_digest(info.capability, _mac(key, request_id, info)):
        raise LandingCapabilityError(
            f"the landing of decode rank {info.rank} was not minted for request "
            f"{request_id!r} by a decode instance of this cluster (forged or altered)"
        )
    if now_s > info.expires_at_s:
        raise LandingCapabilityError(
            f"the landing of decode rank {info.rank} for request {request_id!r} expired "
            f"{now_s - info.expires_at_s:.1f}s ago"
        )
