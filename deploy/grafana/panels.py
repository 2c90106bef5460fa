"""What kvserve's four dashboards show: every panel's PromQL over the metrics in
docs/observability.md (built into JSON by build_dashboards.py)."""

from __future__ import annotations

from model import Dashboard, Panel, Query, quantiles, sel, sum_rate

PROMPT = "kvserve_router_prompt_tokens_total"
GENERATED = "kvserve_router_generation_tokens_total"

OVERVIEW = Dashboard(
    "kvserve-overview",
    "kvserve / Overview",
    "Throughput per GPU, requests, latency and errors of one kvserve cluster.",
    (
        Panel(
            "Throughput per GPU",
            "Every prompt token (cached or not) plus every generated token, per second, "
            "divided by all devices of all prefill and decode instances (DESIGN section 4).",
            (
                Query(
                    f"({sum_rate(PROMPT)} + {sum_rate(GENERATED)}) / "
                    f"sum({sel('kvserve_instance_devices')})",
                    "tokens/s per GPU",
                ),
            ),
            unit="short",
        ),
        Panel(
            "Tokens per second",
            "Prompt tokens by where their KV came from, and generated tokens (router).",
            (
                Query(sum_rate(PROMPT, by="source"), "prompt {{source}}"),
                Query(sum_rate(GENERATED), "generated"),
            ),
            stack=True,
        ),
        Panel(
            "Requests per second by status",
            "Finished requests by endpoint and HTTP status (499: client went away).",
            (
                Query(
                    sum_rate("kvserve_router_requests_total", by="endpoint, status"),
                    "{{endpoint}} {{status}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Requests in flight",
            "Requests the router is serving now.",
            (Query(f"sum({sel('kvserve_router_requests_in_flight')})", "in flight"),),
        ),
        Panel(
            "Time to first token",
            "Request arrival at the router to the first token (p50, p90).",
            quantiles("kvserve_router_time_to_first_token_seconds", what="TTFT"),
            unit="s",
        ),
        Panel(
            "Inter-token latency",
            "Gap between consecutive output tokens at the router (p50, p90).",
            quantiles("kvserve_router_inter_token_latency_seconds", what="ITL"),
            unit="s",
        ),
        Panel(
            "End-to-end latency",
            "Arrival to last token of successful requests (p50, p90).",
            quantiles("kvserve_router_e2e_request_latency_seconds", what="E2E"),
            unit="s",
        ),
        Panel(
            "Errors per second",
            "Requests answered with a non-2xx status (router), and prefill / decode requests "
            "that did not end normally.",
            (
                Query(
                    sum_rate("kvserve_router_requests_total", 'status!~"2.."', by="status"),
                    "router {{status}}",
                ),
                Query(
                    sum_rate(
                        "kvserve_prefill_requests_total",
                        'outcome!~"handed_off|finished"',
                        by="outcome",
                    ),
                    "prefill {{outcome}}",
                ),
                Query(
                    sum_rate("kvserve_decode_requests_total", 'outcome!="finished"', by="outcome"),
                    "decode {{outcome}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Components up",
            "Prometheus' scrape of every component (1 up), and instance health as the router "
            "sees it.",
            (
                Query(sel("up"), "scrape {{instance}}"),
                Query(sel("kvserve_router_instance_healthy"), "routable {{instance}}"),
            ),
        ),
        Panel(
            "Routing decisions",
            "Instances chosen per second, by policy and role.",
            (
                Query(
                    sum_rate("kvserve_router_routed_total", by="policy, role, instance"),
                    "{{policy}} {{role}} {{instance}}",
                ),
            ),
            unit="ops",
        ),
    ),
)

REUSE = Dashboard(
    "kvserve-kv-reuse",
    "kvserve / KV reuse",
    "Where prompt KV comes from (GPU prefix cache, pool, computed), the pool's hits, fill "
    "and evictions.",
    (
        Panel(
            "Prompt tokens by source",
            "Prompt tokens per second whose KV came from the prefill GPU prefix cache (gpu), "
            "the pool (pool), or was computed (prefill instances).",
            (Query(sum_rate("kvserve_prompt_tokens_total", by="source"), "{{source}}"),),
            stack=True,
        ),
        Panel(
            "Share of prompt tokens by source",
            "Fraction of prompt tokens by source; gpu + pool is the reuse.",
            (
                Query(
                    f"{sum_rate('kvserve_prompt_tokens_total', by='source')} / ignoring(source) "
                    f"group_left {sum_rate('kvserve_prompt_tokens_total')}",
                    "{{source}}",
                ),
            ),
            unit="percentunit",
            stack=True,
        ),
        Panel(
            "Pool hit rate",
            "Chunks found in every stage over chunks looked up.",
            (
                Query(
                    f"{sum_rate('kvserve_pool_hit_chunks_total')} / "
                    f"({sum_rate('kvserve_pool_hit_chunks_total')} + "
                    f"{sum_rate('kvserve_pool_miss_chunks_total')})",
                    "hit rate",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Pool lookups and chunks",
            "Lookups per second and the chunks they hit or missed.",
            (
                Query(sum_rate("kvserve_pool_lookups_total"), "lookups"),
                Query(sum_rate("kvserve_pool_hit_chunks_total"), "hit chunks"),
                Query(sum_rate("kvserve_pool_miss_chunks_total"), "miss chunks"),
            ),
            unit="ops",
        ),
        Panel(
            "Pool fill",
            "Bytes allocated in the pool over its capacity (Mooncake master); eviction starts "
            "at pool.master.eviction_high_watermark.",
            (
                Query(
                    f"sum({sel('master_allocated_bytes')}) / "
                    f"sum({sel('master_total_capacity_bytes')})",
                    "fill",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Pool objects",
            "Objects (one per chunk and stage) held by the pool.",
            (Query(f"sum by (instance) ({sel('master_key_count')})", "{{instance}}"),),
        ),
        Panel(
            "Evictions",
            "Pool objects evicted per second (Mooncake master), and prefill (or unified) GPU "
            "prefix-cache blocks evicted for new KV.",
            (
                Query(sum_rate("master_evicted_key_count"), "pool objects"),
                Query(
                    sum_rate(
                        "kvserve_prefix_cache_evictions_total",
                        'role=~"prefill|unified"',
                        by="instance",
                    ),
                    "GPU blocks {{instance}}",
                ),
            ),
            unit="ops",
        ),
        Panel(
            "Pool traffic",
            "Object bytes read from (restores) and written to (saves) the pool.",
            (
                Query(sum_rate("kvserve_pool_load_bytes_total"), "read"),
                Query(sum_rate("kvserve_pool_save_bytes_total"), "written"),
            ),
            unit="Bps",
        ),
        Panel(
            "Save queue",
            "Chunks packed and being written, chunks waiting for a save slot (kept in the GPU "
            "prefix cache), and waiting chunks lost because the cache reused their blocks "
            "first (or an earlier chunk of their chain was lost).",
            (
                Query(
                    f"sum by (instance) ({sel('kvserve_pool_save_queue_depth')})",
                    "queued {{instance}}",
                ),
                Query(
                    f"sum by (instance) ({sel('kvserve_pool_save_waiting')})",
                    "waiting {{instance}}",
                ),
                Query(
                    sum_rate("kvserve_pool_save_lost_total", by="instance"),
                    "lost/s {{instance}}",
                ),
                Query(
                    sum_rate("kvserve_pool_save_dropped_total", by="instance"),
                    "dropped/s {{instance}}",
                ),
            ),
        ),
        Panel(
            "Pool failures",
            "Failed pool operations by operation and reason, and objects that failed their "
            "checksum (removed, recomputed).",
            (
                Query(
                    sum_rate("kvserve_pool_failures_total", by="op, reason"), "{{op}} {{reason}}"
                ),
                Query(sum_rate("kvserve_pool_checksum_failures_total"), "checksum"),
            ),
            unit="ops",
        ),
    ),
)

RESTORE = Dashboard(
    "kvserve-restore-handoff",
    "kvserve / Restore & handoff",
    "Pool restores per stage and the KV handoff from prefill to decode.",
    (
        Panel(
            "Restore latency per stage",
            "One stage's part of a restore: read, verify, unpack (p50, p90).",
            quantiles("kvserve_pool_restore_seconds", by="stage", what="stage"),
            unit="s",
        ),
        Panel(
            "First-to-last stage wait",
            "From the first stage starting a restore to the last stage done (p50, p90).",
            quantiles("kvserve_pool_restore_wait_seconds", what="wait"),
            unit="s",
        ),
        Panel(
            "Restored tokens and pool reads",
            "Prompt tokens restored from the pool per second, and the bytes read for them.",
            (
                Query(sum_rate("kvserve_prompt_tokens_total", 'source="pool"'), "tokens/s"),
                Query(sum_rate("kvserve_pool_load_bytes_total"), "bytes/s"),
            ),
        ),
        Panel(
            "Prefill time to first token",
            "/prefill received to the first token on the prefill instance: queue, restore "
            "and compute (p50, p90).",
            quantiles("kvserve_prefill_first_token_seconds", what="prefill"),
            unit="s",
        ),
        Panel(
            "Handoff throughput",
            "KV bytes per second written from prefill into decode landing buffers.",
            (Query(sum_rate("kvserve_handoff_bytes_total", by="instance"), "{{instance}}"),),
            unit="Bps",
        ),
        Panel(
            "Handoff bandwidth while sending",
            "Handoff bytes over the time spent gathering and writing them.",
            (
                Query(
                    f"{sum_rate('kvserve_handoff_bytes_total')} / "
                    f"{sum_rate('kvserve_handoff_seconds_sum')}",
                    "bytes/s",
                ),
            ),
            unit="Bps",
        ),
        Panel(
            "Handoff ops",
            "Transfer ops (each at most 8 MiB) per second, and per request.",
            (
                Query(sum_rate("kvserve_handoff_ops_total"), "ops/s"),
                Query(
                    f"{sum_rate('kvserve_handoff_ops_total')} / "
                    f"{sum_rate('kvserve_handoff_seconds_count')}",
                    "ops/request",
                ),
            ),
        ),
        Panel(
            "Handoff latency per request",
            "One request's gather + write time on a prefill stage (p50, p90).",
            quantiles("kvserve_handoff_seconds", what="handoff"),
            unit="s",
        ),
        Panel(
            "Handoff bytes per request",
            "One request's handoff bytes (p50, p90).",
            quantiles("kvserve_handoff_request_bytes", what="bytes"),
            unit="bytes",
        ),
        Panel(
            "Decode scatter latency",
            "Landed KV of one request scattered into decode's paged KV (p50, p90).",
            quantiles("kvserve_decode_scatter_seconds", what="scatter"),
            unit="s",
        ),
    ),
)

CAPACITY = Dashboard(
    "kvserve-capacity",
    "kvserve / Capacity",
    "KV utilization, queues, landing space and admission of prefill and decode.",
    (
        Panel(
            "KV cache utilization",
            "Fraction of paged KV blocks held by requests, per instance.",
            (
                Query(
                    f"max by (role, instance) ({sel('kvserve_kv_cache_usage_ratio')})",
                    "{{role}} {{instance}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Queues",
            "Requests running, waiting for admission to the batch, and waiting for pool KV.",
            (
                Query(
                    f"sum by (role, instance) ({sel('kvserve_num_requests_running')})",
                    "running {{role}} {{instance}}",
                ),
                Query(
                    f"sum by (role, instance) ({sel('kvserve_num_requests_waiting')})",
                    "waiting {{role}} {{instance}}",
                ),
                Query(
                    f"sum by (role, instance) ({sel('kvserve_num_requests_loading_kv')})",
                    "loading KV {{role}} {{instance}}",
                ),
            ),
        ),
        Panel(
            "Admission",
            "Requests the router's admission gate rejected per second by reason, those it "
            "holds in its queue, and the decode KV tokens it has reserved per instance.",
            (
                Query(
                    sum_rate("kvserve_router_admission_rejections_total", by="reason"),
                    "rejected {{reason}}",
                ),
                Query(f"sum({sel('kvserve_router_admission_waiting')})", "queued"),
                Query(
                    f"sum by (instance) ({sel('kvserve_router_admission_reserved_tokens')})",
                    "reserved tokens {{instance}}",
                ),
            ),
        ),
        Panel(
            "Landing buffer",
            "Fraction of decode's landing arena held by requests, from /decode until no write can be in flight.",
            (
                Query(
                    f"sum by (instance) ({sel('kvserve_landing_used_bytes')}) / "
                    f"sum by (instance) ({sel('kvserve_landing_capacity_bytes')})",
                    "{{instance}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Landing wait",
            "Time /decode waited for landing space (p50, p90): back-pressure from decode.",
            quantiles("kvserve_landing_wait_seconds", what="wait"),
            unit="s",
        ),
        Panel(
            "Generated tokens per second",
            "Tokens sampled by role (prefill: first tokens; decode: the rest).",
            (Query(sum_rate("kvserve_generated_tokens_total", by="role"), "{{role}}"),),
            stack=True,
        ),
        Panel(
            "Preemptions",
            "Requests preempted for lack of KV blocks (recomputed later), and steps whose "
            "admission kept a prompt waiting because it does not fit beside the running ones "
            "(whole_prompt admission: the waiting that replaces preemption), per second.",
            (
                Query(
                    sum_rate("kvserve_engine_preemptions_total", by="role, instance"),
                    "preempted {{role}} {{instance}}",
                ),
                Query(
                    sum_rate("kvserve_engine_admissions_deferred_total", by="role, instance"),
                    "deferred {{role}} {{instance}}",
                ),
            ),
            unit="ops",
        ),
        Panel(
            "Pool capacity",
            "Bytes the pool's stores contribute and bytes allocated (Mooncake master).",
            (
                Query(f"sum({sel('master_total_capacity_bytes')})", "capacity"),
                Query(f"sum({sel('master_allocated_bytes')})", "allocated"),
            ),
            unit="bytes",
        ),
        Panel(
            "Devices",
            "Devices per role: the denominator of throughput per GPU.",
            (Query(f"sum by (role) ({sel('kvserve_instance_devices')})", "{{role}}"),),
        ),
    ),
)

DASHBOARDS = (OVERVIEW, REUSE, RESTORE, CAPACITY)
