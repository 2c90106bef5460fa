"""The trace replay of the pool simulator (benchmarks/pool_policy_sim.py): the agentic
replay's closed loops over the caches (benchmarks/pool_sim_cache.py), the save path
(benchmarks/pool_sim_save.py) and a prefill queue: one server of whole requests at
`compute_tok_s` (`queue="server"`, the calibration of the pool tables), or the engine's
steps under a prefill discipline (benchmarks/pool_sim_queue.py)."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from benchmarks.agentic.trace import CeilingCounter, Trace, TraceRequest
from benchmarks.pool_sim_cache import (
    CHUNK_TOKENS,
    OBJECT_OVERHEAD,
    TOKEN_BYTES,
    GpuCache,
    Pool,
)
from benchmarks.pool_sim_save import SaveItem, SavePath

if TYPE_CHECKING:
    from benchmarks.pool_sim_gates import GateStats


@dataclass(frozen=True)
class Policy:
    write: str  # through | victim | exclusive
    evict: str  # mooncake | pin | client-hits | client


@dataclass
class Model:
    compute_tok_s: float = 9_500.0
    restore_gbs: float = 2.6
    itl_s: float = 0.014
    time_scale: float = 0.1
    duration_s: float = 180.0
    gpu_blocks: int = 262_144 // 64
    pool_objects: int = int(80 * 2**30 // (CHUNK_TOKENS * TOKEN_BYTES + OBJECT_OVERHEAD))
    budget: float = 0.85
    pin_ttl_s: float = 60.0
    save_slots: int | None = 15
    """Save slots of the prefill's pool buffer (1 GiB: 31 slots of 32 MiB, 15 for saves;
    4 GiB: 63; 6 GiB: 95); None: never short of slots."""
    save_gbs: float = 0.9
    """Rate of the save thread's writes (a slot is busy from its chunk's pack to the end
    of its write); calibrated on the fourth H200 run's 813 dropped of 4,847 (drop mode)."""
    save_wait: bool = True
    """What is built (prefill_worker/pool_save_queue.py): a chunk with no free slot waits
    and is packed from the GPU prefix cache when one frees, lost if the cache evicted
    it first (with the rest of its chain). False: dropped at once (before)."""
    queue: str = "server"
    """"server": one FIFO server of whole requests at compute_tok_s; else the engine's
    steps under that prefill discipline (benchmarks/pool_sim_queue.py: fcfs, srpf, cap)."""
    step_tokens: int = 8192
    """The step's token budget (max_batched_tokens)."""
    max_seqs: int = 64
    """Requests admitted at once (max_num_seqs)."""
    chunk_cap: int = 2048
    """cap: the most tokens one request takes in a step while another wants tokens."""
    aging_tokens: float = 2048.0
    """srpf: priority tokens a request gains per step since its arrival."""
    bound_steps: int = 64
    """shortest: steps after its arrival from which a request goes first (by arrival)."""
    step_token_s: float = 18.6e-6
    """Step cost per token (weights, MLP, projections): 8K tokens with no prefix at
    ~39.6K tok/s on one H200, less the attention term below."""
    step_pair_s: float = 1.63e-9
    """Step cost per (query, key) pair of causal attention: 8K tokens over a 56K prefix
    at ~8.4K tok/s on one H200 (docs/benchmarks.md, the GPU engine)."""
    step_overhead_s: float = 0.004
    """Fixed cost of a step (host scheduling, launches)."""
    step_share: float = 1.0
    """Slowdown of the prefill's steps on a GPU that decode shares (calibrated)."""
    gate: str | None = None
    """The gates in front of the prefill queue (benchmarks/pool_sim_gates.py): None: none
    (requests reach prefill on arrival); else the admission gate's order (fifo, fits,
    smallest, late, off) followed by decode's landing arena."""
    gate_bound_s: float = 2.0
    """fits / smallest: once the head of the line has waited this long nobody passes it."""
    decode_kv_tokens: int = 46 * 2**30 // TOKEN_BYTES
    """Decode's KV capacity (kv_cache_memory / 128 KiB a token)."""
    gate_headroom: float = 0.9
    """router.admission.headroom: the share of decode_kv_tokens the gate hands out."""
    landing_bytes: int = 10 * 2**30
    """decode's landing_memory."""
    landing_region_bytes: int = 512 * 2**20
    """decode's landing_region: the most one request holds."""
    handoff_s: float = 0.04
    """From the prefill's last step to the prompt landed (the region freed)."""


@dataclass
class Result:
    requests: int = 0
    prompt: int = 0
    gpu: int = 0
    pool: int = 0
    computed: int = 0
    ttfts: list[float] = field(default_factory=list)
    ceiling: float = 0.0
    saved: int = 0
    save_deferred: int = 0
    save_dropped: int = 0
    save_lost: int = 0
    steps: int = 0
    busy_s: float = 0.0
    gates: GateStats | None = None

    def quantiles(self) -> tuple[float, float]:
        t = sorted(self.ttfts)
        return t[len(t) // 2], t[int(len(t) * 0.9)]

    def row(self, name: str) -> str:
        reuse = (self.gpu + self.pool) / self.prompt
        p50, p90 = self.quantiles()
        return (
            f"| {name} | {self.requests} | {100 * self.gpu / self.prompt:.1f}% | "
            f"{100 * self.pool / self.prompt:.1f}% | {100 * reuse:.1f}% | "
            f"{100 * reuse / self.ceiling:.1f}% | {p50:.1f} / {p90:.1f} s | "
            f"{self.saved} / {self.save_deferred} / {self.save_dropped} / {self.save_lost} |"
        )


def chain(req: TraceRequest) -> list[int]:
    """Prefix hash of every trace block (equal ids at equal prefixes: equal keys)."""
    out, h = [], 0
    for x in req.hash_ids:
        h = hash((h, x))
        out.append(h)
    return out


@dataclass
class Served:
    """One request as the caches see it: its keys, and what its admission found."""

    req: TraceRequest
    keys: list[int]
    ckeys: list[int]
    arrive: float
    gpu_tok: int = 0
    pool_tok: int = 0

    @property
    def computed(self) -> int:
        return self.req.input_length - self.gpu_tok - self.pool_tok


class Reuse:
    """The GPU prefix cache, the pool and the save path of one replay: `lookup` at a
    request's admission, `store` when its prefill ends."""

    def __init__(self, trace: Trace, policy: Policy, m: Model, seed: int, res: Result) -> None:
        self.bt = trace.block_tokens
        self.per_chunk = CHUNK_TOKENS // self.bt
        self.policy, self.m, self.res = policy, m, res
        self.gpu = GpuCache(m.gpu_blocks)
        self.pool = Pool(
            m.pool_objects,
            random.Random(seed + 1),
            client_budget=m.budget if policy.evict.startswith("client") else None,
            pin_ttl_s=m.pin_ttl_s if policy.evict == "pin" else 0.0,
        )
        # Victim writes: a chunk goes to the pool when the GPU evicts its last block still
        # held, if all its blocks were still there (the data to save).
        self.chunk_of: dict[int, tuple[int, int]] = {}  # block key -> (chunk key, depth)
        self.blocks_of: dict[int, list[int]] = {}
        self.now = 0.0
        self.saver = SavePath(m, self.gpu, self.pool, res)
        if policy.write != "through":
            self.gpu.on_evict = self._on_evict

    def _on_evict(self, k: int) -> None:
        info = self.chunk_of.get(k)
        if info is None:
            return
        ck, depth = info
        blocks = self.blocks_of.get(ck, [])
        if blocks and all(b in self.gpu.lru or b == k for b in blocks) and ck not in self.pool.objs:
            self.saver.now(ck, depth, self.now)

    def served(self, req: TraceRequest, arrive: float) -> Served:
        keys = chain(req)
        pc = self.per_chunk
        ckeys = [keys[c * pc + pc - 1] for c in range(len(keys) // pc)]
        for c, ck in enumerate(ckeys):
            self.chunk_of.setdefault(ck, (ck, c))
            self.blocks_of.setdefault(ck, keys[c * pc : (c + 1) * pc])
            for b in keys[c * pc : (c + 1) * pc]:
                self.chunk_of[b] = (ck, c)
        return Served(req, keys, ckeys, arrive)

    def lookup(self, s: Served, start: float) -> None:
        """The GPU prefix hit, then the pool's leading run after it (whole chunks)."""
        self.now = start
        pool, req, ckeys = self.pool, s.req, s.ckeys
        g = min(self.gpu.hit(s.keys), len(s.keys) - 1)
        s.gpu_tok = g * self.bt
        first = s.gpu_tok // CHUNK_TOKENS
        last = (req.input_length - 1) // CHUNK_TOKENS
        s.pool_tok = 0
        if self.policy.evict == "client":  # the request's whole chain is in use (its stamp)
            pool.touch(ckeys[: max(first, last)], start, 0)
        if first < last:
            run = 0
            for f in pool.exists(ckeys[first:last], start):
                if not f:
                    break
                run += 1
            if run:
                s.pool_tok = (first + run) * CHUNK_TOKENS - s.gpu_tok
                pool.touch(ckeys[first : first + run], start, first)
                if self.policy.write == "exclusive":
                    pool.remove(ckeys[first : first + run])

    def peek(self, s: Served) -> int:
        """Tokens `lookup` would leave to compute now, changing nothing (the engine's
        estimate of a waiting request: its GPU prefix, then the pool's answer)."""
        req = s.req
        gpu_tok = min(self.gpu.hit(s.keys), len(s.keys) - 1) * self.bt
        first = gpu_tok // CHUNK_TOKENS
        last = (req.input_length - 1) // CHUNK_TOKENS
        run = 0
        if first < last:
            for f in self.pool.exists(s.ckeys[first:last], self.now, lease=False):
                if not f:
                    break
                run += 1
        pool_tok = (first + run) * CHUNK_TOKENS - gpu_tok if run else 0
        return req.input_length - gpu_tok - pool_tok

    def restore_s(self, s: Served) -> float:
        return s.pool_tok * TOKEN_BYTES / (self.m.restore_gbs * 1e9)

    def store(self, s: Served, start: float, end: float, computed_at: list[float]) -> None:
        """The prefill ended at `end`: its computed chunks go to the save path (chunk c's
        tokens were computed at computed_at[c - first saved chunk]), its blocks into the
        GPU prefix cache."""
        self.now = end
        req, bt, pc = s.req, self.bt, self.per_chunk
        if self.policy.write == "through":
            save_from = (s.gpu_tok + s.pool_tok) // CHUNK_TOKENS
            full = req.input_length // CHUNK_TOKENS
            stamp = start if self.policy.evict == "client" else None
            for c in range(save_from, full):
                item = SaveItem(
                    computed_at[c - save_from],
                    end,
                    s.ckeys[c],
                    s.keys[c * pc : (c + 1) * pc],
                    c,
                    stamp,
                    len(self.res.ttfts),
                )
                self.saver.offer(item)
            self.saver.advance(end)  # before the GPU cache changes at `end`
        self.gpu.insert(s.keys[: req.input_length // bt])

    def done(self, s: Served, first_token: float) -> None:
        res = self.res
        res.requests += 1
        res.prompt += s.req.input_length
        res.gpu += s.gpu_tok
        res.pool += s.pool_tok
        res.computed += s.computed
        res.ttfts.append(first_token - s.arrive)


class Threads:
    """The replay's closed loops: a thread's next request after its previous one's
    output (plus its wait x time_scale), subagents spawned and joined; nothing sent after
    the duration. `pop()` gives the next arrival in time order."""

    def __init__(self, trace: Trace, m: Model, seed: int, ceiling: CeilingCounter) -> None:
        self.trace, self.m, self.ceiling = trace, m, ceiling
        rng = random.Random(seed)
        offsets = {s: rng.uniform(0, 1.0) for s in trace.sessions}
        self.threads = {t.key: t for t in trace.threads}
        self.thread_end: dict[str, float] = {}
        self.parked: dict[str, list] = {}
        self.ready: list[tuple[float, int, str, int]] = []
        self.seq = 0
        for t in trace.threads:
            if t.parent is None:
                self._push(offsets[t.session], t.key, 0)

    def _push(self, at: float, key: str, i: int) -> None:
        heapq.heappush(self.ready, (at, self.seq, key, i))
        self.seq += 1

    def next_ready(self) -> float | None:
        return self.ready[0][0] if self.ready else None

    def pop(self) -> tuple[str, int, TraceRequest, float] | None:
        """The next ready request with its arrival time, or None when it was parked
        (joins) or not sent (past the duration)."""
        ready, _, key, i = heapq.heappop(self.ready)
        t = self.threads[key]
        req = t.requests[i]
        joins = [f"{t.session}/{j}" for j in req.join]
        if any(j not in self.thread_end for j in joins):
            self.parked.setdefault(key, []).append((joins, i))
            return None
        arrive = max([ready] + [self.thread_end[j] for j in joins]) + req.wait_s * self.m.time_scale
        if arrive >= self.m.duration_s:
            self._finish(key, arrive)  # the replay stopped sending
            return None
        self.ceiling.add(req.hash_ids, req.input_length)
        return key, i, req, arrive

    def answered(self, key: str, i: int, finished: float) -> None:
        """Request i of thread `key` finished its output at `finished`."""
        t = self.threads[key]
        if i + 1 < len(t.requests):
            self._push(finished, key, i + 1)
        else:
            self._finish(key, finished)
        for sub in self.trace.threads:
            if sub.session == t.session and sub.parent == t.thread and sub.spawn_after == i:
                self._push(finished, sub.key, 0)

    def _finish(self, key: str, at: float) -> None:
        self.thread_end[key] = at
        for wkey, items in list(self.parked.items()):
            keep = []
            for joins, i in items:
                if all(j in self.thread_end for j in joins):
                    at_join = max(self.thread_end[j] for j in joins)
                    heapq.heappush(self.ready, (at_join, -1, wkey, i))
                else:
                    keep.append((joins, i))
            if keep:
                self.parked[wkey] = keep
            else:
                del self.parked[wkey]


def simulate(trace: Trace, policy: Policy, m: Model, seed: int = 0) -> Result:
    if m.queue != "server":
        from benchmarks.pool_sim_queue import simulate_steps

        return simulate_steps(trace, policy, m, seed)
    res = Result()
    ceiling = CeilingCounter(trace.block_tokens)
    reuse = Reuse(trace, policy, m, seed, res)
    threads = Threads(trace, m, seed, ceiling)
    server_free = 0.0
    while threads.ready:
        got = threads.pop()
        if got is None:
            continue
        key, i, req, arrive = got
        s = reuse.served(req, arrive)
        start = max(arrive, server_free)
        reuse.lookup(s, start)
        end = start + s.computed / m.compute_tok_s
        server_free = end
        base = s.gpu_tok + s.pool_tok
        save_from = base // CHUNK_TOKENS
        full = req.input_length // CHUNK_TOKENS
        at = [
            start + ((c + 1) * CHUNK_TOKENS - base) / m.compute_tok_s
            for c in range(save_from, full)
        ]
        reuse.store(s, start, end, at)
        first_token = max(end, start + reuse.restore_s(s))
        reuse.done(s, first_token)
        threads.answered(key, i, first_token + req.output_length * m.itl_s)
    res.ceiling = ceiling.ceiling
    return res
