"""The routers kvserve's router is measured beside: sglang-router and vllm-router, both
Rust, both pip-installable. Each lives in its own virtual environment under
~/.cache/kvserve/ (created once, then reused; not in CI), runs in prefill/decode mode in
front of the stand-in workers (benchmarks/router_standins.py) and is told the same
policy as kvserve's router (round robin over one prefill and one decode).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CACHE = Path.home() / ".cache" / "kvserve"


@dataclass(frozen=True)
class Peer:
    name: str
    package: str
    version: str
    module: str
    """`python -m module` starts the router."""
    pd_flag: str

    @property
    def venv(self) -> Path:
        return CACHE / self.name

    def ensure(self, wheels: str | None = None) -> Path:
        """The venv's python with `package==version` installed (created once); `wheels`: a
        folder holding it and its dependencies, for a machine without a package registry."""
        py = self.venv / "bin" / "python"
        check = [str(py), "-m", "pip", "show", "-q", self.package]
        version_ok = False
        if py.exists():
            out = subprocess.run(
                [str(py), "-m", "pip", "show", self.package], capture_output=True, text=True
            )
            version_ok = f"Version: {self.version}" in out.stdout
        if not version_ok:
            subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True)
            pip = [str(py), "-m", "pip", "install", "-q"]
            if wheels is not None:
                pip += ["--no-index", "--find-links", wheels]
            subprocess.run([*pip, f"{self.package}=={self.version}"], check=True)
            subprocess.run(check, check=True)
        return py

    def command(
        self, py: Path, port: int, metrics_port: int, prefill_url: str, decode_url: str
    ) -> list[str]:
        level = "warn" if self.name == "sglang-router" else "warning"
        return [
            str(py),
            "-m",
            self.module,
            self.pd_flag,
            "--prefill",
            prefill_url,
            "--decode",
            decode_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--log-level",
            level,
        ]


SGLANG = Peer(
    "sglang-router", "sglang-router", "0.3.2", "sglang_router.launch_router", "--pd-disaggregation"
)
VLLM = Peer(
    "vllm-router", "vllm-router", "0.1.17", "vllm_router.launch_router", "--vllm-pd-disaggregation"
)
PEERS = {p.name: p for p in (SGLANG, VLLM)}
