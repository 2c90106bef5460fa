"""Injected handoff faults, for tests of the failure paths only (cluster.yaml
`prefill[].handoff_faults`; off by default). They act in the sender's writer thread,
exactly where a real transport fails or stalls."""

from __future__ import annotations

import time
from dataclasses import dataclass

from transfer.errors import TransferError


@dataclass(frozen=True)
class HandoffFaults:
    """What to inject: a failed write of every request with `fail_prompt_tokens` prompt
    tokens, after its first piece (a transfer failed mid-flight), and a delay before every
    write (a slow transport)."""

    fail_prompt_tokens: int | None = None
    write_delay_s: float = 0.0

    def before_write(self, num_prompt_tokens: int, token_start: int) -> None:
        """Called before each write of a piece starting at prompt token `token_start`."""
        if self.write_delay_s > 0:
            time.sleep(self.write_delay_s)
        if self.fail_prompt_tokens == num_prompt_tokens and token_start > 0:
            raise TransferError(
                f"injected fault: write of a {num_prompt_tokens}-token prompt's KV failed "
                f"at token {token_start} (handoff_faults.fail_prompt_tokens)"
            )
