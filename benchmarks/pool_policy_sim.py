"""Pool retention policies on the agentic trace, simulated on the CPU in seconds.

    python -m benchmarks.pool_policy_sim [--sessions 32] [--turns 10] [--max-context 60000]
        [--seed 0] [--gpu-tokens 262144] [--pool-gib 80] [--save-slots 15] [--runs 3]
        [--save-gbs 0.9] [--save-mode wait|drop] [--policies a,b,...]

Replays the synthetic trace of `kvserve bench agentic --synthetic` (same generator, same
seed, the replay's closed loops: start offsets, waits x time_scale, subagent spawns and
joins, no request sent after --duration) through a model of one prefill instance:

    arrival ─▶ FIFO prefill queue ─▶ service start: GPU prefix hit, then pool hit, the
               (one server,          rest computed at --compute-tok-s; the restore runs
                computed tokens)     beside it at --restore-gbs) ─▶ decode (out x ITL) ─▶
               next turn after its wait

    GPU prefix cache   engine/block_pool.py: LRU free queue of blocks (here the trace's
                       64-token blocks), a request's blocks freed tail-first
    save path          --save-slots slots, one write at a time at --save-gbs (SavePath):
                       a chunk with no free slot waits in the GPU cache and is lost if
                       evicted first, with the rest of its chain (wait: what
                       prefill_worker/pool_save_queue.py does), or is dropped (drop)
    pool               chunk objects (256 tokens, 128 KiB a token: 32 MiB), a store of
                       --pool-gib, evicted as the policy says

Mooncake's own eviction (master_service.cpp BatchEvict, 0.3.13), modelled as it is: above
the high watermark (0.9) a pass evicts a fraction (0.05 + the excess) of the OBJECTS, shard
by shard over 1024 hash shards (a random first shard); each shard evicts its share of
the running quota from its own lease-expired, unpinned objects, those with the oldest
lease_timeout first, and ties at the cut all go. A put leaves lease_timeout at the epoch
(never read objects are the oldest); batch_is_exist and reads grant a 10 s lease. A soft
pin makes an object a second-pass candidate (evicted only when too few others are), its
timeout renewed on every lease. With ~2,300 objects of 32 MiB over 1024 shards a shard
holds ~2 of them, so "approximately LRU" is close to random in practice, and a random
hole in a session's chain loses everything behind it (the hit rule is a leading run).

Policies (`write/evict`):
    through/mooncake    today: every computed prompt chunk saved when computed, Mooncake
                        evicts
    through/pin         + soft pin on every save (DESIGN §12 session retention), TTL
                        --pin-ttl, renewed by lookups
    through/client      the client evicts first, as kvpool/retention.py does (pool.retention:
                        client): it keeps what it wrote under --budget of the store,
                        removing least recently used chains tail first; a request's whole
                        chain (also the part the GPU served) and its saves get the
                        request's stamp; Mooncake never reaches its watermark
    through/client-hits the same eviction, but only pool hits are touched (at the lookup)
                        and saves stamped when written
    victim/client       chunks are saved when the GPU cache evicts them, not when computed
                        (pool.save: victim; a victim with no free save slot is lost)
    exclusive/client    victim + a chunk restored into the GPU is removed from the pool
                        (simulated only)

Numbers that calibrate the model (the third H200 run, docs/benchmarks.md): computed
prompt tokens at ~9.5K tok/s, restore 2.6 GB/s, ITL 14 ms, 424 requests in 180 s.
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from benchmarks.agentic.synthetic import generate
from benchmarks.agentic.trace import CeilingCounter, Trace, TraceRequest

TOKEN_BYTES = 131_072
CHUNK_TOKENS = 256
NUM_SHARDS = 1024
LEASE_S = 10.0
WATERMARK = 0.9
EVICT_RATIO = 0.05
OBJECT_OVERHEAD = 4096
"""Header and slot alignment of a pool object beside its payload."""


# -- the GPU prefix cache ---------------------------------------------------------------------
class GpuCache:
    """Prefix cache of `capacity` trace blocks, LRU, a request's blocks freed tail-first
    (engine/block_pool.py). `on_evict(key)` hears every eviction (the victim policies)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()  # front = evicted first
        self.on_evict = None

    def hit(self, keys: list[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.lru:
                break
            n += 1
        return n

    def insert(self, keys: list[int]) -> None:
        for k in reversed(keys):  # tail first: the prefix is evicted last
            if k in self.lru:
                self.lru.move_to_end(k)
            else:
                self.lru[k] = None
        while len(self.lru) > self.capacity:
            k, _ = self.lru.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(k)


# -- the pool ---------------------------------------------------------------------------------
@dataclass
class _Obj:
    shard: int
    lease: float = -1.0  # lease_timeout; -1: the epoch (never read)
    pin_until: float = -1.0
    touched: float = 0.0  # the client's recency (a request's use stamp)
    depth: int = 0  # chunk index in its chain (tail-first ties)
    used_at: float = 0.0  # when last used (the client never removes one used < 10 s ago)


@dataclass
class Pool:
    """Chunk objects in a store of `capacity` objects; Mooncake's eviction, or the
    client's own (budget) when `client_budget` is set."""

    capacity: int
    rng: random.Random
    client_budget: float | None = None
    pin_ttl_s: float = 0.0
    objs: dict[int, _Obj] = field(default_factory=dict)
    evicted: int = 0

    def exists(self, keys: list[int], now: float, lease: bool = True) -> list[bool]:
        out = []
        for k in keys:
            o = self.objs.get(k)
            out.append(o is not None)
            if o is not None and lease:
                o.lease = max(o.lease, now + LEASE_S)
                if o.pin_until >= 0:
                    o.pin_until = max(o.pin_until, now + self.pin_ttl_s)
        return out

    def touch(self, keys: list[int], now: float, first_depth: int) -> None:
        for i, k in enumerate(keys):
            o = self.objs.get(k)
            if o is not None:
                o.touched = max(o.touched, now)
                o.depth = first_depth + i
                o.used_at = now

    def put(
        self, keys: list[int], now: float, first_depth: int, stamp: float | None = None
    ) -> None:
        for i, k in enumerate(keys):
            if k in self.objs:
                continue  # put of an existing key: 0, nothing changes
            if self.client_budget is not None:
                self._client_evict(now, reserve=1)
            elif len(self.objs) >= self.capacity:
                self._mooncake_evict(now, EVICT_RATIO)
                if len(self.objs) >= self.capacity:
                    continue  # NO_SPACE (retried once in the client; ignored here)
            pin = now + self.pin_ttl_s if self.pin_ttl_s > 0 else -1.0
            recency = now if stamp is None else stamp
            self.objs[k] = _Obj(hash(k) % NUM_SHARDS, -1.0, pin, recency, first_depth + i, now)
            if self.client_budget is None and len(self.objs) > WATERMARK * self.capacity:
                excess = len(self.objs) / self.capacity - WATERMARK
                self._mooncake_evict(now, EVICT_RATIO + excess)

    def remove(self, keys: list[int]) -> None:
        for k in keys:
            self.objs.pop(k, None)

    def _client_evict(self, now: float, reserve: int) -> None:
        assert self.client_budget is not None
        limit = int(self.client_budget * self.capacity) - reserve
        if len(self.objs) <= limit:
            return
        over = len(self.objs) - int(limit * 0.97)  # removals come in batches
        # Least recently used first; within one recency the deepest chunk first, so a
        # chain loses its tail and keeps a usable prefix. Chunks used in the last 10 s
        # stay (a load may be reading them).
        order = sorted(
            (o.touched, -o.depth, k) for k, o in self.objs.items() if now - o.used_at >= LEASE_S
        )
        for _, _, k in order[:over]:
            del self.objs[k]
            self.evicted += 1

    def _mooncake_evict(self, now: float, target: float) -> None:
        shards: dict[int, list[int]] = {}
        for k, o in self.objs.items():
            shards.setdefault(o.shard, []).append(k)
        start = self.rng.randrange(NUM_SHARDS)
        count = evicted = 0
        second: list[tuple[float, int]] = []
        pinned: list[tuple[float, int]] = []
        for i in range(NUM_SHARDS):
            keys = shards.get((start + i) % NUM_SHARDS, [])
            count += len(keys)
            quota = -(-int(count * target * 1e9) // int(1e9)) - evicted
            cands = []
            for k in keys:
                o = self.objs[k]
                if o.lease > now:
                    continue
                if o.pin_until > now:
                    pinned.append((o.lease, k))
                elif quota > 0:
                    cands.append((o.lease, k))
                else:
                    second.append((o.lease, k))
            if quota > 0 and cands:
                cands.sort()
                cut = cands[min(quota, len(cands)) - 1][0]
                for lease, k in cands:
                    if lease <= cut:
                        del self.objs[k]
                        evicted += 1
                    else:
                        second.append((lease, k))
        want = -(-int(count * EVICT_RATIO * 1e9) // int(1e9)) - evicted
        if want > 0:
            pool = sorted(second) + sorted(pinned)
            for _, k in pool[:want]:
                self.objs.pop(k, None)
                evicted += 1
        self.evicted += evicted


# -- the replay -------------------------------------------------------------------------------
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


@dataclass
class Result:
    requests: int = 0
    prompt: int = 0
    gpu: int = 0
    pool: int = 0
    ttfts: list[float] = field(default_factory=list)
    ceiling: float = 0.0
    saved: int = 0
    save_deferred: int = 0
    save_dropped: int = 0
    save_lost: int = 0

    def row(self, name: str) -> str:
        reuse = (self.gpu + self.pool) / self.prompt
        t = sorted(self.ttfts)
        p50 = t[len(t) // 2]
        p90 = t[int(len(t) * 0.9)]
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


def simulate(trace: Trace, policy: Policy, m: Model, seed: int = 0) -> Result:
    bt = trace.block_tokens
    per_chunk = CHUNK_TOKENS // bt
    rng = random.Random(seed)
    gpu = GpuCache(m.gpu_blocks)
    pool = Pool(
        m.pool_objects,
        random.Random(seed + 1),
        client_budget=m.budget if policy.evict.startswith("client") else None,
        pin_ttl_s=m.pin_ttl_s if policy.evict == "pin" else 0.0,
    )
    # Victim writes: a chunk goes to the pool when the GPU evicts its last block still
    # held, if all its blocks were still there (the data to save).
    chunk_of: dict[int, tuple[int, int]] = {}  # block key -> (chunk key, depth)
    blocks_of: dict[int, list[int]] = {}
    now_box = [0.0]
    if policy.write != "through":

        def on_evict(k: int) -> None:
            info = chunk_of.get(k)
            if info is None:
                return
            ck, depth = info
            blocks = blocks_of.get(ck, [])
            if blocks and all(b in gpu.lru or b == k for b in blocks) and ck not in pool.objs:
                saver.now(ck, depth, now_box[0])

        gpu.on_evict = on_evict

    ceiling = CeilingCounter(bt)
    res = Result()
    saver = SavePath(m, gpu, pool, res)  # (on_evict above uses it once events run)
    offsets = {s: rng.uniform(0, 1.0) for s in trace.sessions}
    threads = {t.key: t for t in trace.threads}
    thread_end: dict[str, float] = {}
    waiting: dict[str, list] = {}
    events: list[tuple[float, int, str, int]] = []
    seq = 0
    for t in trace.threads:
        if t.parent is None:
            heapq.heappush(events, (offsets[t.session], seq, t.key, 0))
            seq += 1
    server_free = 0.0
    while events:
        ready, _, key, i = heapq.heappop(events)
        t = threads[key]
        req = t.requests[i]
        # joins: wait for the subagent threads to end
        joins = [f"{t.session}/{j}" for j in req.join]
        if any(j not in thread_end for j in joins):
            waiting.setdefault(key, []).append((joins, i))
            continue
        arrive = max([ready] + [thread_end[j] for j in joins]) + req.wait_s * m.time_scale
        if arrive >= m.duration_s:
            _finish(key, arrive, thread_end, waiting, events)  # the replay stopped sending
            continue
        ceiling.add(req.hash_ids, req.input_length)
        start = max(arrive, server_free)
        now_box[0] = start
        keys = chain(req)
        n = len(keys)
        ckeys = [keys[c * per_chunk + per_chunk - 1] for c in range(n // per_chunk)]
        for c, ck in enumerate(ckeys):
            chunk_of.setdefault(ck, (ck, c))
            blocks_of.setdefault(ck, keys[c * per_chunk : (c + 1) * per_chunk])
            for b in keys[c * per_chunk : (c + 1) * per_chunk]:
                chunk_of[b] = (ck, c)
        g = min(gpu.hit(keys), n - 1)
        gpu_tok = g * bt
        first = gpu_tok // CHUNK_TOKENS
        last = (req.input_length - 1) // CHUNK_TOKENS
        pool_tok = 0
        if policy.evict == "client":  # the request's whole chain is in use (its stamp)
            pool.touch(ckeys[: max(first, last)], start, 0)
        if first < last:
            found = pool.exists(ckeys[first:last], start)
            run = 0
            for f in found:
                if not f:
                    break
                run += 1
            if run:
                pool_tok = (first + run) * CHUNK_TOKENS - gpu_tok
                pool.touch(ckeys[first : first + run], start, first)
                if policy.write == "exclusive":
                    pool.remove(ckeys[first : first + run])
        computed = req.input_length - gpu_tok - pool_tok
        service = computed / m.compute_tok_s
        restore = pool_tok * TOKEN_BYTES / (m.restore_gbs * 1e9)
        end = start + service
        server_free = end
        now_box[0] = end
        if policy.write == "through":
            save_from = (gpu_tok + pool_tok) // CHUNK_TOKENS
            full = req.input_length // CHUNK_TOKENS
            stamp = start if policy.evict == "client" else None
            for c in range(save_from, full):
                done = start + ((c + 1) * CHUNK_TOKENS - gpu_tok - pool_tok) / m.compute_tok_s
                saver.offer(
                    _Waiting(
                        done,
                        end,
                        ckeys[c],
                        keys[c * per_chunk : (c + 1) * per_chunk],
                        c,
                        stamp,
                        len(res.ttfts),
                    )
                )
            saver.advance(end)  # before the GPU cache changes at `end`
        gpu.insert(keys[: req.input_length // bt])
        first_token = max(end, start + restore)
        res.requests += 1
        res.prompt += req.input_length
        res.gpu += gpu_tok
        res.pool += pool_tok
        res.ttfts.append(first_token - arrive)
        finished = first_token + req.output_length * m.itl_s
        # the thread's next request, and subagents spawned after this one
        if i + 1 < len(t.requests):
            heapq.heappush(events, (finished, seq, key, i + 1))
            seq += 1
        else:
            _finish(key, finished, thread_end, waiting, events)
        for sub in trace.threads:
            if sub.session == t.session and sub.parent == t.thread and sub.spawn_after == i:
                heapq.heappush(events, (finished, seq, sub.key, 0))
                seq += 1
    res.ceiling = ceiling.ceiling
    return res


@dataclass
class _Waiting:
    """A computed chunk on its way to a save slot."""

    done: float  # computed (packed at once if a slot is free)
    owned_until: float  # its request ends: until then its blocks cannot be evicted
    key: int
    blocks: list[int]
    depth: int
    stamp: float | None
    chain: int  # the request it belongs to


class SavePath:
    """The save slots and the save thread, FIFO: a chunk takes a slot when it is packed
    and frees it when its write ends (writes one at a time at m.save_gbs); chunk i gets
    the slot of chunk i - slots. No slot free when it is computed: dropped (save_wait
    False), or it waits and is packed when the slot frees, if the GPU cache still holds
    all its blocks (else lost, and its chain's later chunks with it, taking no slot).
    `advance(now)` settles every chunk whose slot time is due, before the GPU cache
    changes at `now`."""

    def __init__(self, m: Model, gpu: GpuCache, pool: Pool, res: Result) -> None:
        self.m, self.gpu, self.pool, self.res = m, gpu, pool, res
        self.write_s = CHUNK_TOKENS * TOKEN_BYTES / (m.save_gbs * 1e9)
        self.ends: deque[float] = deque()  # write ends of the last `slots` chunks
        self.writer_free = 0.0
        self.waiting: deque[_Waiting] = deque()
        self.broken: set[int] = set()

    def offer(self, w: _Waiting) -> None:
        self.waiting.append(w)

    def now(self, key: int, depth: int, t: float) -> None:
        """A victim (pool.save victim): saved at once if a slot is free at t, else lost
        (the cache is reusing its blocks)."""
        m = self.m
        full = m.save_slots is not None and len(self.ends) >= m.save_slots
        if full and m.save_slots is not None and self.ends[-m.save_slots] > t:
            self.res.save_lost += 1
            return
        end = max(t, self.writer_free) + self.write_s
        self.writer_free = end
        self.ends.append(end)
        if m.save_slots is not None and len(self.ends) > m.save_slots:
            self.ends.popleft()
        self.res.saved += 1
        self.pool.put([key], t, depth)

    def advance(self, now: float) -> None:
        m = self.m
        while self.waiting:
            w = self.waiting[0]
            slot_t = w.done
            if m.save_slots is not None and len(self.ends) >= m.save_slots:
                slot_t = max(slot_t, self.ends[-m.save_slots])
            if slot_t > now:
                return
            self.waiting.popleft()
            if slot_t > w.done and not m.save_wait:
                self.res.save_dropped += 1
                continue
            if w.chain in self.broken:
                self.res.save_lost += 1
                continue
            if slot_t > w.owned_until and not all(b in self.gpu.lru for b in w.blocks):
                self.res.save_lost += 1
                self.broken.add(w.chain)
                continue
            if slot_t > w.done:
                self.res.save_deferred += 1
            end = max(slot_t, self.writer_free) + self.write_s
            self.writer_free = end
            self.ends.append(end)
            if m.save_slots is not None and len(self.ends) > m.save_slots:
                self.ends.popleft()
            self.res.saved += 1
            self.pool.put([w.key], slot_t, w.depth, w.stamp)


def _finish(key: str, at: float, thread_end: dict, waiting: dict, events: list) -> None:
    thread_end[key] = at
    for wkey, items in list(waiting.items()):
        keep = []
        for joins, i in items:
            if all(j in thread_end for j in joins):
                heapq.heappush(events, (max(thread_end[j] for j in joins), -1, wkey, i))
            else:
                keep.append((joins, i))
        if keep:
            waiting[wkey] = keep
        else:
            del waiting[wkey]


POLICIES = (
    Policy("through", "mooncake"),
    Policy("through", "pin"),
    Policy("through", "client-hits"),
    Policy("through", "client"),
    Policy("victim", "client"),
    Policy("exclusive", "client"),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-context", type=int, default=60_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-tokens", type=int, default=262_144)
    p.add_argument("--pool-gib", type=float, default=80.0)
    p.add_argument("--compute-tok-s", type=float, default=9_500.0)
    p.add_argument("--budget", type=float, default=0.85)
    p.add_argument("--pin-ttl", type=float, default=60.0)
    p.add_argument("--save-slots", type=int, default=15, help="save slots (0: unlimited)")
    p.add_argument("--save-gbs", type=float, default=0.9, help="the save thread's write rate")
    p.add_argument(
        "--save-mode",
        choices=("wait", "drop"),
        default="wait",
        help="a chunk with no free slot waits in the GPU cache (built) or is dropped (before)",
    )
    p.add_argument("--runs", type=int, default=3, help="Mooncake's random shard starts")
    p.add_argument("--policies", default=",".join(f"{x.write}/{x.evict}" for x in POLICIES))
    args = p.parse_args(argv)
    trace = generate(
        sessions=args.sessions, turns=args.turns, max_context=args.max_context, seed=args.seed
    )
    m = Model(
        compute_tok_s=args.compute_tok_s,
        gpu_blocks=args.gpu_tokens // trace.block_tokens,
        pool_objects=int(args.pool_gib * 2**30 // (CHUNK_TOKENS * TOKEN_BYTES + OBJECT_OVERHEAD)),
        budget=args.budget,
        pin_ttl_s=args.pin_ttl,
        save_slots=args.save_slots or None,
        save_gbs=args.save_gbs,
        save_wait=args.save_mode == "wait",
    )
    print(
        f"trace: {len(trace.sessions)} sessions, {trace.num_requests} requests; GPU cache "
        f"{args.gpu_tokens} tokens, pool {m.pool_objects} chunks ({m.pool_objects * 256} tokens)"
    )
    print(
        "| policy | requests | GPU | pool | reuse | of ceiling | TTFT p50 / p90 "
        "| saved / waited / dropped / lost |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    for label in args.policies.split(","):
        write, evict = label.split("/")
        for run in range(args.runs if evict in ("mooncake", "pin") else 1):
            r = simulate(trace, Policy(write, evict), m, seed=run)
            print(r.row(label + (f" (run {run})" if evict in ("mooncake", "pin") else "")))
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
