"""Injected handoff faults, for tests of the failure paths only (cluster.yaml
`prefill[].handoff_faults`; off by default). They act in the sender's writer thread,
exactly where a real transport fails or stalls."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

from transfer.errors import TransferError

HOLD_MAX_S = 300.0


@dataclass(frozen=True)
class HandoffFaults:
    """What to inject: a failed write of every request with `fail_prompt_tokens` prompt
    tokens, after its first piece (a transfer failed mid-flight), a delay before every
    write (a slow transport), and a held write (below)."""

    fail_prompt_tokens: int | None = None
    write_delay_s: float = 0.0
    hold_prompt_tokens: int | None = None
    """A request with this many prompt tokens waits at prefill's door, before its engine,
    until `hold_until_file` exists (at most HOLD_MAX_S): a request queued in prefill
    while the decode it was reserved on dies and restarts."""
    hold_until_file: str | None = None

    def before_write(self, num_prompt_tokens: int, token_start: int) -> None:
        """Called before each write of a piece starting at prompt token `token_start`."""
        if self.write_delay_s > 0:
            time.sleep(self.write_delay_s)
        if self.fail_prompt_tokens == num_prompt_tokens and token_start > 0:
            raise TransferError(
                f"injected fault: write of a {num_prompt_tokens}-token prompt's KV failed "
                f"at token {token_start} (handoff_faults.fail_prompt_tokens)"
            )

    async def hold(self, num_prompt_tokens: int) -> None:
        """Called by prefill's service before a request enters its engine."""
        if self.hold_prompt_tokens != num_prompt_tokens or not self.hold_until_file:
            return
        with open(self.hold_until_file + ".held", "a"):
            pass  # tells the test the request is held now
        deadline = time.monotonic() + HOLD_MAX_S
        while not os.path.exists(self.hold_until_file) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
