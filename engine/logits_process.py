"""Penalties and logit bias over a batch of logits rows, vectorized on the logits' device.

Per row, in this order (vLLM's order; each rule as its reference defines it):

    repetition_penalty  transformers' RepetitionPenaltyLogitsProcessor over prompt + output
                        tokens: logit > 0 -> logit / p, else logit * p
    frequency_penalty   OpenAI: logit -= frequency_penalty * count(token in output)
    presence_penalty    OpenAI: logit -= presence_penalty * (count(token in output) > 0)
    logit_bias          OpenAI: logit += bias[token]

Token lists travel to the device as one padded tensor per rule (a host-to-device copy,
no device-to-host sync). A row of padding uses the id V, a column cut off afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.sampling import SamplingParams


def _padded(lists: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0) or 1
    out = torch.full((len(lists), width), pad, dtype=torch.int64)
    for i, ids in enumerate(lists):
        if ids:
            out[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    return out.to(device, non_blocking=True)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """[M, V] logits (float32) of M rows that process logits -> a new [M, V] tensor."""
    device = logits.device
    vocab = logits.shape[1]
    x = logits.clone()

    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        seen_lists = [list(prompt_token_ids[i]) + list(output_token_ids[i]) for i in rep_rows]
        ids = _padded(seen_lists, vocab, device)
        seen = torch.zeros(len(rep_rows), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, ids, True)
        seen = seen[:, :vocab]
        idx = torch.tensor(rep_rows, device=device)
        penalty = torch.tensor(
            [params[i].repetition_penalty for i in rep_rows], dtype=x.dtype, device=device
        ).unsqueeze(1)
        rows = x[idx]
        scaled = torch.where(rows > 0, rows / penalty, rows * penalty)
        x[idx] = torch.where(seen, scaled, rows)

    count_rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if count_rows:
        ids = _padded([output_token_ids[i] for i in count_rows], vocab, device)
        counts = torch.zeros(len(count_rows), vocab + 1, dtype=x.dtype, device=device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=x.dtype))
        counts = counts[:, :vocab]
        idx = torch.tensor(count_rows, device=device)
        freq = torch.tensor(
            [params[i].frequency_penalty for i in count_rows], dtype=x.dtype, device=device
        ).unsqueeze(1)
        pres = torch.tensor(
            [params[i].presence_penalty for i in count_rows], dtype=x.dtype, device=device
        ).unsqueeze(1)
        x[idx] = x[idx] - freq * counts - pres * (counts > 0).to(x.dtype)

    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for i, p in enumerate(params):
        for token_id, bias in p.logit_bias:
            if token_id < vocab:  # ids past the logits (a padded vocabulary) never occur
                bias_rows.append(i)
                bias_ids.append(token_id)
                bias_values.append(bias)
    if bias_rows:
        x.index_put_(
            (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device)),
            torch.tensor(bias_values, dtype=x.dtype, device=device),
            accumulate=True,
        )
    return x
