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

Mooncake's own eviction is modelled as master_service.cpp does it (benchmarks/pool_sim_cache.py).

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
import time
from dataclasses import replace

from benchmarks.agentic.synthetic import generate
from benchmarks.agentic.trace import Trace
from benchmarks.pool_sim_cache import CHUNK_TOKENS, OBJECT_OVERHEAD, TOKEN_BYTES, GpuCache, Pool
from benchmarks.pool_sim_replay import Model, Policy, Result, simulate

__all__ = ["GpuCache", "Model", "Policy", "Pool", "Result", "main", "simulate"]


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
    p.add_argument("--restore-gbs", type=float, default=2.6, help="a restore's stage rate")
    p.add_argument("--itl", type=float, default=0.014, help="decode's inter-token latency (s)")
    p.add_argument(
        "--queues",
        default="",
        help="prefill disciplines to compare (one policy, the first): NAME[:PARAM][@BUDGET],"
        " NAME fcfs | srpf (PARAM: aging tokens a step) | cap (PARAM: chunk cap);"
        " BUDGET the step's tokens (default --step-tokens); empty: the one-server queue",
    )
    p.add_argument("--step-tokens", type=int, default=8192, help="max_batched_tokens")
    p.add_argument("--max-seqs", type=int, default=64, help="max_num_seqs")
    p.add_argument("--step-share", type=float, default=1.0, help="prefill slowdown (shared GPU)")
    p.add_argument(
        "--step-pair-ns",
        type=float,
        default=1.63,
        help="a step's cost per (query, key) pair of attention (ns; 1.02 with cuDNN attention)",
    )
    p.add_argument(
        "--gates",
        default="",
        help="admission gates to compare (the first --queues discipline, default shortest:64):"
        " ORDER[:BOUND_S][@DECODE_KV_GIB], ORDER fifo | fits | smallest | late | off"
        " (benchmarks/pool_sim_gates.py); empty: no gates",
    )
    p.add_argument("--decode-kv-gib", type=float, default=46.0, help="decode kv_cache_memory")
    p.add_argument("--landing-gib", type=float, default=10.0, help="decode landing_memory")
    p.add_argument("--landing-region-mib", type=float, default=512.0, help="landing_region")
    p.add_argument(
        "--handoff-s",
        type=float,
        default=0.04,
        help="from the prefill's end to the prompt landed in decode (the region freed)",
    )
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
        restore_gbs=args.restore_gbs,
        itl_s=args.itl,
        step_tokens=args.step_tokens,
        max_seqs=args.max_seqs,
        step_share=args.step_share,
        step_pair_s=args.step_pair_ns * 1e-9,
        decode_kv_tokens=int(args.decode_kv_gib * 2**30) // TOKEN_BYTES,
        landing_bytes=int(args.landing_gib * 2**30),
        landing_region_bytes=int(args.landing_region_mib * 2**20),
        handoff_s=args.handoff_s,
    )
    print(
        f"trace: {len(trace.sessions)} sessions, {trace.num_requests} requests; GPU cache "
        f"{args.gpu_tokens} tokens, pool {m.pool_objects} chunks ({m.pool_objects * 256} tokens)"
    )
    if args.gates:
        discipline = (args.queues or "shortest:64").split(",")[0]
        m = queue_model(m, discipline)
        return _gates(trace, args.policies.split(",")[0], m, args.gates.split(","))
    if args.queues:
        return _queues(trace, args.policies.split(",")[0], m, args.queues.split(","))
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


def queue_model(m: Model, spec: str) -> Model:
    """The model with the discipline of `spec` (NAME[:PARAM][@BUDGET])."""
    spec, _, budget = spec.partition("@")
    name, _, param = spec.partition(":")
    m = replace(m, queue=name, step_tokens=int(budget) if budget else m.step_tokens)
    if name == "srpf" and param:
        m = replace(m, aging_tokens=float(param))
    elif name == "shortest" and param:
        m = replace(m, bound_steps=int(param))
    elif name == "cap" and param:
        m = replace(m, chunk_cap=int(param))
    elif param:
        raise ValueError(f"{name} takes no parameter: {spec!r}")
    return m


def _queues(trace: Trace, label: str, m: Model, specs: list[str]) -> int:
    write, evict = label.split("/")
    print(
        "| prefill discipline | requests | computed | reuse of ceiling | steps | busy "
        "| TTFT p50 / p90 / p99 / max |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    for spec in specs:
        r = simulate(trace, Policy(write, evict), queue_model(m, spec))
        p50, p90 = r.quantiles()
        t = sorted(r.ttfts)
        p99 = t[int(len(t) * 0.99)]
        reuse = (r.gpu + r.pool) / r.prompt
        print(
            f"| {spec} | {r.requests} | {100 * r.computed / r.prompt:.1f}% | "
            f"{100 * reuse / r.ceiling:.1f}% | {r.steps} | {r.busy_s:.0f} s | "
            f"{p50:.2f} / {p90:.2f} / {p99:.1f} / {t[-1]:.1f} s |"
        )
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


def gate_model(m: Model, spec: str) -> Model:
    """The model with the admission gate of `spec` (ORDER[:BOUND_S][@DECODE_KV_GIB])."""
    spec, _, gib = spec.partition("@")
    order, _, bound = spec.partition(":")
    m = replace(m, gate=order)
    if gib:
        m = replace(m, decode_kv_tokens=int(float(gib) * 2**30) // TOKEN_BYTES)
    if bound:
        if order not in ("fits", "smallest"):
            raise ValueError(f"{order} takes no bound: {spec!r}")
        m = replace(m, gate_bound_s=float(bound))
    return m


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _gates(trace: Trace, label: str, m: Model, specs: list[str]) -> int:
    write, evict = label.split("/")
    print(
        "| admission gate | requests | TTFT p50 / p90 / p99 / max | mean: admission "
        "/ landing / prefill | end to end p50 | peak reserved |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    for spec in specs:
        gm = gate_model(m, spec)
        r = simulate(trace, Policy(write, evict), gm)
        g = r.gates
        assert g is not None
        t = sorted(r.ttfts)
        p50, p90 = r.quantiles()
        budget = int(gm.decode_kv_tokens * gm.gate_headroom)
        print(
            f"| {spec} | {r.requests} | {p50:.2f} / {p90:.2f} / {t[int(len(t) * 0.99)]:.1f} "
            f"/ {t[-1]:.1f} s | {_mean(g.admission_s):.2f} / {_mean(g.landing_s):.2f} / "
            f"{_mean(g.prefill_s):.2f} s | {sorted(g.e2e_s)[len(g.e2e_s) // 2]:.2f} s | "
            f"{g.max_reserved // 1000}K of {budget // 1000}K |"
        )
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
