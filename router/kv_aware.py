"""The KV-aware policies: `kv_aware` (the default) and `session` (DESIGN §5 step 3, §12).

kv_aware, prefill: power of two choices, priced in seconds.

    candidates  A = the instance with the longest GPU-resident prefix (ties: random),
                B = another one at random (with two instances: both)
    price(i)    = compute_i / rate_i                      prompt tokens it must compute
                + restore_i x bytes/token / restore_bw_i   tokens it restores from its pool
                + outstanding_i / rate_i                   prompt tokens already sent to it

    gpu_i     = leading prompt blocks in i's prefix cache (KV events), x block size
    pool_i    = leading prompt chunks in i's pool (router/kv_index.py), beyond gpu_i
    compute_i = prompt - gpu_i - pool_i       (at least one token is always computed)

Rates are the workers' measured ones (GET /kv_events load); until an instance has
measured one, the mean of the others, else the priors below. A pool hit is therefore
priced with the live restore path (bytes x measured bandwidth) against recomputing, not
assumed free. The cheaper candidate wins; a candidate within TIE_FRACTION of it that
served the request's session last time wins the tie (affinity breaks ties, never rules:
with a shared pool any prefill can serve any turn).

A: the longest-prefix instance is always a candidate because with more than two
instances two random picks would usually both miss the one holding the session's KV.

decode (kv_aware and session): two random candidates; the one with more free KV after
the admission gate's reservations, then fewer requests in flight.

session: a session's requests go to the prefill instance its first request went to while
that instance is routable; otherwise (or without a session id) the least loaded one, and
the session moves there.

unified instances (router/unified.py) are chosen by both policies with the prefill rules:
what they cache, what their pool holds and the prompt tokens already sent to them.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.hashing import chunk_keys
from router.cluster_view import ClusterView, InstanceState
from router.instances import Instance, Role
from router.policies import RouteContext, RoutingPolicy, register_policy

PRIOR_COMPUTE_TOKENS_PER_S = 1000.0
PRIOR_RESTORE_BYTES_PER_S = 1e9
TIE_FRACTION = 0.05
"""Prices within 5% (or TIE_S) are a tie, broken by session affinity."""
TIE_S = 0.002
MAX_SESSIONS = 100_000


@dataclass(frozen=True)
class Price:
    """What serving a request on one prefill instance would take, by the router's view."""

    gpu_tokens: int
    pool_tokens: int
    compute_tokens: int
    cost_s: float


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class Pricer:
    """Prices a request on prefill instances from a ClusterView (read only)."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view

    def rates(self, candidates: Sequence[Instance]) -> tuple[dict[str, float], dict[str, float]]:
        """Compute and restore rates per candidate name, filled in where unmeasured."""
        loads = {i.name: self.view.state(i).load for i in candidates}
        comp = {n: ld.compute_tokens_per_s for n, ld in loads.items() if ld is not None}
        rest = {n: ld.restore_bytes_per_s for n, ld in loads.items() if ld is not None}
        comp_default = _mean([v for v in comp.values() if v]) or PRIOR_COMPUTE_TOKENS_PER_S
        rest_default = _mean([v for v in rest.values() if v]) or PRIOR_RESTORE_BYTES_PER_S
        return (
            {i.name: comp.get(i.name) or comp_default for i in candidates},
            {i.name: rest.get(i.name) or rest_default for i in candidates},
        )

    def gpu_blocks(self, st: InstanceState, ctx: RouteContext) -> int:
        if st.info is None or st.root is None:
            return 0
        return st.prefix.match_blocks(ctx.block_hashes(st.info.block_size, st.root))

    def price(
        self, inst: Instance, ctx: RouteContext, compute_rate: float, restore_rate: float
    ) -> Price:
        st = self.view.state(inst)
        n = len(ctx.prompt_token_ids)
        gpu = pool = 0
        bytes_per_token = 0
        if st.info is not None and st.root is not None:
            bs, cs = st.info.block_size, st.info.chunk_size
            bytes_per_token = st.info.kv_bytes_per_token
            chain = ctx.block_hashes(bs, st.root)
            # The engine computes at least the last prompt token (its logits are sampled).
            gpu = min(st.prefix.match_blocks(chain) * bs, (n - 1) // bs * bs)
            index = self.view.pool(st.pool_id)
            if index is not None and len(index):
                chunks = index.match_chunks(chunk_keys(chain, cs // bs))
                pool = max(0, min(chunks * cs, (n - 1) // cs * cs) - gpu)
        compute = n - gpu - pool
        cost = (compute + st.outstanding_tokens) / compute_rate
        cost += pool * bytes_per_token / restore_rate
        return Price(gpu, pool, compute, cost)


def pick_decode(view: ClusterView, candidates: Sequence[Instance], rng: random.Random) -> Instance:
    """Two random candidates; more free KV (after reservations), then fewer in flight."""
    pair = list(candidates) if len(candidates) <= 2 else rng.sample(list(candidates), 2)

    def key(inst: Instance) -> tuple[float, int]:
        st = view.state(inst)
        cap = st.info.kv_capacity_tokens if st.info is not None else 0
        return (-(cap - st.reserved_tokens), st.num_in_flight)

    return min(pair, key=key)


class _SessionMap:
    """Session id -> instance name, bounded (oldest sessions forgotten first)."""

    def __init__(self) -> None:
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str | None) -> str | None:
        return None if session is None else self._map.get(session)

    def set(self, session: str | None, name: str) -> None:
        if session is None:
            return
        self._map[session] = name
        self._map.move_to_end(session)
        if len(self._map) > MAX_SESSIONS:
            self._map.popitem(last=False)


@register_policy
class SessionPolicy(RoutingPolicy):
    """Session affinity for prefill (falls back when the instance is not routable);
    decode by headroom. Owns the session map."""

    name = "session"

    def __init__(self, seed: int | None = None, view: ClusterView | None = None) -> None:
        self.view = view if view is not None else ClusterView()
        self._rng = random.Random(seed)
        self._sessions = _SessionMap()
        self._next = 0

    def choose(self, role: Role, ctx: RouteContext, candidates: Sequence[Instance]) -> Instance:
        if role == "decode":
            return pick_decode(self.view, candidates, self._rng)
        pinned = self._sessions.get(ctx.session_id)
        for inst in candidates:
            if inst.name == pinned:
                return inst
        if ctx.session_id is None:
            self._next += 1
            return candidates[self._next % len(candidates)]
        inst = min(
            candidates,
            key=lambda i: (self.view.state(i).outstanding_tokens, self._rng.random()),
        )
        self._sessions.set(ctx.session_id, inst.name)
        return inst


@register_policy
class KVAwarePolicy(RoutingPolicy):
    """Prefix-, pool- and load-priced power of two choices (see the module docstring).
    Owns the session map of its tie-breaks and the last prices (for logs and tests)."""

    name = "kv_aware"

    def __init__(self, seed: int | None = None, view: ClusterView | None = None) -> None:
        self.view = view if view is not None else ClusterView()
        self.pricer = Pricer(self.view)
        self._rng = random.Random(seed)
        self._sessions = _SessionMap()
        self.last_prices: dict[str, Price] = {}

    def choose(self, role: Role, ctx: RouteContext, candidates: Sequence[Instance]) -> Instance:
        if role == "decode":
            return pick_decode(self.view, candidates, self._rng)
        pair = self._candidates(ctx, candidates)
        comp, rest = self.pricer.rates(pair)
        prices = {i.name: self.pricer.price(i, ctx, comp[i.name], rest[i.name]) for i in pair}
        self.last_prices = prices
        best = min(pair, key=lambda i: (prices[i.name].cost_s, self._rng.random()))
        best_cost = prices[best.name].cost_s
        pinned = self._sessions.get(ctx.session_id)
        for inst in pair:
            if inst.name == pinned and inst is not best:
                cost = prices[inst.name].cost_s
                if cost <= best_cost * (1 + TIE_FRACTION) or cost - best_cost <= TIE_S:
                    best = inst
        self._sessions.set(ctx.session_id, best.name)
        ctx.predicted_compute_tokens = prices[best.name].compute_tokens
        return best

    def _candidates(self, ctx: RouteContext, candidates: Sequence[Instance]) -> list[Instance]:
        if len(candidates) <= 2:
            return list(candidates)
        shuffled = list(candidates)
        self._rng.shuffle(shuffled)
        first = max(
            shuffled, key=lambda i: self.pricer.gpu_blocks(self.view.state(i), ctx)
        )  # max keeps the first of equals: a random one among the best
        second = self._rng.choice([i for i in shuffled if i is not first])
        return [first, second]
