"""Where the native data plane's binary is (docs/edge.md), building it when asked.

`KVSERVE_EDGE_BIN` names a binary to use; otherwise edge/target/release/kvserve-edge of
this source tree, which scripts/setup.sh builds (`cargo build --release --offline`, every
crate from Debian's packages).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

EDGE_DIR = Path(__file__).resolve().parent.parent / "edge"
BINARY_NAME = "kvserve-edge"


class EdgeUnavailable(RuntimeError):
    """No kvserve-edge binary, and none could be built."""


def edge_binary(*, build: bool = False) -> Path:
    """The binary to run; with `build`, `cargo build` it first when the source tree has
    one to build (a no-op when it is up to date)."""
    named = os.environ.get("KVSERVE_EDGE_BIN")
    if named:
        path = Path(named)
        if not path.is_file():
            raise EdgeUnavailable(f"KVSERVE_EDGE_BIN={named} is not a file")
        return path
    path = EDGE_DIR / "target" / "release" / BINARY_NAME
    if build and (EDGE_DIR / "Cargo.toml").is_file():
        cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
        try:
            subprocess.run(
                [cargo, "build", "--release", "--offline", "--quiet"],
                cwd=EDGE_DIR,
                check=True,
                capture_output=True,
                text=True,
            )
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            raise EdgeUnavailable(f"building {EDGE_DIR} failed: {detail.strip()[-2000:]}") from e
    if not path.is_file():
        raise EdgeUnavailable(
            f"{path} does not exist: build it with `cargo build --release --offline` in "
            f"{EDGE_DIR} (scripts/setup.sh does), or set KVSERVE_EDGE_BIN"
        )
    return path
