#!/usr/bin/env bash
# Agentic serving on ONE GPU: prefill + decode on GPU 0 (cuda_ipc handoff), the KV pool in
# host DRAM, a random-weight Llama-3-8B-shaped bf16 model built offline.
#
#   benchmarks/gpu_serving.sh prepare        # here, with a package index: fills .gpu-serving/
#   benchmarks/gpu_serving.sh run OUT_DIR    # on the GPU machine (carry .gpu-serving/)
#
# prepare: cp312 wheels of what the GPU machine lacks (docs: fastapi's stack, uvicorn,
#   httptools, msgspec, gguf, the Mooncake Transfer Engine for the pool) and the Debian
#   packages of libibverbs / librdmacm Mooncake links against, into .gpu-serving/ (ignored
#   by git via .git/info/exclude; ~52 MB, under the 64 MiB a GPU call carries).
# run: installs them under /tmp, builds the model (benchmarks/random_model.py), writes a copy
#   of deploy/examples/single-gpu.yaml with the model's folder, `kvserve check`, `kvserve up`,
#   then
#     kvserve bench agentic --url http://127.0.0.1:8000 --synthetic --sessions 32 --turns 10
#       --max-context 60000 --seed 0 --duration 180 --time-scale 0.1 --vocab-size 49000
#       --gpus 1 --out OUT_DIR/agentic
#   and prints the report plus the handoff (prefill kvserve_handoff_*, decode scatter) and
#   pool restore (kvserve_pool_restore_*) figures scraped from the instances' /metrics.
#   prefill-0 and decode-0 record their engine steps and requests' milestones
#   (KVSERVE_STEP_TRACE=OUT_DIR/trace, engine/step_trace.py; GPU_SERVING_TRACE=0 turns it
#   off); at the end the traces are gzipped (a decode step of 32 rows is ~2 KB, ~0.15 KB
#   gzipped: a few MB a run) and benchmarks/serving_timeline.py prints, per instance, the
#   first 60 s in 5 s windows then 30 s ones (busy fraction, step split, gaps, tokens,
#   rows, preemptions, CPU against wall) and the cold start of the 32 sessions' first
#   turns, also into OUT_DIR/timeline.txt and OUT_DIR/timeline.json.
#   Takes ~6 min (model build ~30 s, two 16 GB weight loads, 180 s of load, drain).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CARRY="$ROOT/.gpu-serving"
PY="${PYTHON:-python3}"

WHEELS=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvloop
  typing-extensions opentelemetry-api importlib-metadata uvicorn httptools msgspec gguf
  "llguidance>=1.9,<2" mooncake-transfer-engine-non-cuda==0.3.13.post1)
DEBS=(libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200)

prepare() {
  mkdir -p "$CARRY/wheels" "$CARRY/debs"
  local exclude
  exclude="$(git -C "$ROOT" rev-parse --path-format=absolute --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.gpu-serving/' "$exclude" 2>/dev/null || echo '/.gpu-serving/' >>"$exclude"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$CARRY/wheels" "${WHEELS[@]}"
  (cd "$CARRY/debs" && apt-get download "${DEBS[@]}")
  du -sh "$CARRY"
}

metric_lines() { # URL PATTERN: the /metrics lines of a component matching PATTERN
  "$PY" - "$1" "$2" <<'EOF'
import re, sys, httpx
text = httpx.get(sys.argv[1] + "/metrics", timeout=10, trust_env=False).text
for line in text.splitlines():
    # Zeros are printed too: a counter at 0 (no save waited, none lost) is a finding.
    if re.match(sys.argv[2], line) and "_created" not in line:
        print("   ", line)
EOF
}

run() {
  mkdir -p "$1"
  local out
  out="$(cd "$1" && pwd)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-serving-site "$CARRY"/wheels/*.whl
  mkdir -p /tmp/gpu-serving-root
  for f in "$CARRY"/debs/*.deb; do dpkg -x "$f" /tmp/gpu-serving-root; done
  export LD_LIBRARY_PATH="/tmp/gpu-serving-root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  export PYTHONPATH="$ROOT:/tmp/gpu-serving-site${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  cd "$ROOT"

  local model=/tmp/llama-3-8b-random
  "$PY" -m benchmarks.random_model "$model"
  local trace=""
  if [ "${GPU_SERVING_TRACE:-1}" != 0 ]; then
    trace="$out/trace"
    rm -rf "$trace"
    mkdir -p "$trace"
  fi
  "$PY" - "$model" "$out/single-gpu.yaml" "$trace" <<'EOF'
import sys, yaml
cfg = yaml.safe_load(open("deploy/examples/single-gpu.yaml"))
cfg["model"] = sys.argv[1]
cfg["cache"]["weights_cache_dir"] = "/tmp/kvserve-weights"
if sys.argv[3]:  # the engines' steps and requests' milestones (engine/step_trace.py)
    for inst in cfg["prefill"] + cfg["decode"]:
        inst["env"] = {**inst.get("env", {}), "KVSERVE_STEP_TRACE": sys.argv[3]}
yaml.safe_dump(cfg, open(sys.argv[2], "w"), sort_keys=False)
EOF
  local config="$out/single-gpu.yaml" state=/tmp/gpu-serving-state
  "$PY" -m kvserve.cli check -c "$config" | tee "$out/check.txt"
  "$PY" -m kvserve.cli up -c "$config" --detach --state-dir "$state"
  # Expanded now: the trap runs after run() returned, when its locals are gone.
  trap "\"$PY\" -m kvserve.cli down -c \"$config\" --state-dir \"$state\" || true" EXIT
  # The device's memory in use, once a second for the whole load (the budget kvserve check
  # printed is an estimate; this is what the processes really hold, graphs and cuDNN
  # workspaces included).
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits -lms 1000 \
    >"$out/gpu_memory.csv" 2>/dev/null &
  local smi=$!

  "$PY" -m kvserve.cli bench agentic --url http://127.0.0.1:8000 --synthetic --sessions 32 \
    --turns 10 --max-context 60000 --seed 0 --duration 180 --time-scale 0.1 \
    --vocab-size 49000 --gpus 1 --out "$out/agentic" 2>&1 | tee "$out/agentic.log"

  echo "== report"
  cat "$out/agentic/report.json"
  echo "== prefill queue (prefill-0: prompt tokens by source, time to first token, preemptions)"
  metric_lines http://127.0.0.1:8100 'kvserve_(prompt_tokens_total|prefill_first_token_seconds_(sum|count)|engine_preemptions_total|engine_recomputed_tokens_total)'
  echo "== handoff (prefill-0 sends, decode-0 scatters; cuda_ipc)"
  metric_lines http://127.0.0.1:8100 'kvserve_handoff_(bytes|ops|seconds_(sum|count))'
  metric_lines http://127.0.0.1:8200 'kvserve_(handoff_flows_total|decode_scatter_seconds_(sum|count)|landing_wait_seconds_(sum|count))'
  echo "== pool restore (prefill-0)"
  metric_lines http://127.0.0.1:8100 'kvserve_pool_(load_bytes|restored_tokens|restore_seconds_(sum|count)|restore_wait_seconds_(sum|count)|restore_phase_seconds_total)'
  echo "== pool saves and retention (prefill-0; the master's evictions)"
  metric_lines http://127.0.0.1:8100 'kvserve_pool_(save_chunks_total|save_dropped_total|save_deferred_total|save_lost_total|save_waiting|save_phase_seconds_total|save_bytes_total|retention_removed_total|retained_chunks|hit_chunks_total|miss_chunks_total|failures_total)'
  metric_lines http://127.0.0.1:9003 'master_(key_count|allocated_bytes|total_capacity_bytes|evicted_key_count|successful_evictions_total|put_start_alloc_failures_total)'
  echo "== the router's admission gate (decode KV headroom) and decode's landing room"
  metric_lines http://127.0.0.1:8000 'kvserve_router_admission_(wait_seconds_(sum|count)|rejections_total)' || true
  metric_lines http://127.0.0.1:8200 'kvserve_(landing_capacity_bytes|num_requests_(running|waiting|loading_kv))' || true
  kill "$smi" 2>/dev/null || true
  echo "== device memory (MiB): peak in use during the run, per process at the end"
  sort -t, -k1 -n "$out/gpu_memory.csv" | tail -n 1 | sed 's/^/    peak used, total: /'
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | sed 's/^/    /'
  if [ -n "$trace" ]; then
    "$PY" -m kvserve.cli down -c "$config" --state-dir "$state" || true
    timeline "$out"
  fi
}

timeline() { # OUT: gzip OUT/trace's step traces (the cluster is down), print their timeline
  local out
  out="$(cd "$1" && pwd)"
  for f in "$out"/trace/*.jsonl; do
    [ -e "$f" ] || continue
    gzip -f "$f"
  done
  echo "== engine steps and request milestones (benchmarks/serving_timeline.py; OUT/trace)"
  ls -l "$out"/trace | sed 's/^/    /'
  local requests=()
  [ -e "$out/agentic/requests.jsonl" ] && requests=(--requests "$out/agentic/requests.jsonl")
  (cd "$ROOT" && PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m benchmarks.serving_timeline \
    "$out/trace" "${requests[@]}" --window 5 --fine-s 60 --coarse 30 --cold 32 \
    --json "$out/timeline.json") | tee "$out/timeline.txt"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run "${2:?usage: gpu_serving.sh run OUT_DIR}" ;;
  timeline) timeline "${2:?usage: gpu_serving.sh timeline OUT_DIR}" ;;
  *) echo "usage: $0 prepare | run OUT_DIR | timeline OUT_DIR" >&2; exit 2 ;;
esac
