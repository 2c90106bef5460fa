"""`python -m router -c cluster.yaml`: run the router section of a cluster (what the
kvserve launcher starts)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import msgspec

from protocol.cluster import load_cluster
from protocol.config_errors import ConfigError
from protocol.errors import KvserveError
from protocol.internal_auth import SECRET_ENV, secret_from_env
from router.config import settings_from_cluster
from router.processes import RouterProcesses, die_with_parent
from router.server import run_router


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    parser.add_argument("-c", "--config", required=True, help="cluster.yaml")
    parser.add_argument("--port", type=int, default=None, help="override router.port")
    parser.add_argument(
        "--process-index",
        type=int,
        default=0,
        help="which of router.processes this is (process 0 starts the others)",
    )
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="process 0's pid (processes above 0)"
    )
    args = parser.parse_args(argv)
    if args.process_index > 0:
        if args.parent_pid is None:
            parser.error("--process-index above 0 needs --parent-pid")
        die_with_parent(args.parent_pid)
    try:
        cluster = load_cluster(args.config)
        settings = settings_from_cluster(cluster)
    except (ConfigError, ValueError) as e:
        print(f"router: {e}", file=sys.stderr)
        return 2
    who = "router" if settings.processes == 1 else f"router[{args.process_index}]"
    logging.basicConfig(
        level=cluster.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {who} %(name)s: %(message)s",
    )
    # httpx logs every request at INFO: health checks and notices would flood the log
    logging.getLogger("httpx").setLevel(logging.WARNING)
    secret = secret_from_env()
    if secret is None:
        logging.getLogger("router").warning(
            "%s is not set: calls to the workers carry no cluster secret and workers "
            "started by kvserve up will refuse them (401)",
            SECRET_ENV,
        )
    settings = msgspec.structs.replace(settings, cluster_secret=secret)
    if args.port is not None:
        settings = msgspec.structs.replace(settings, port=args.port)
    if not 0 <= args.process_index < settings.processes:
        print(
            f"router: --process-index {args.process_index} is not below router.processes "
            f"({settings.processes})",
            file=sys.stderr,
        )
        return 2
    settings = msgspec.structs.replace(settings, process_index=args.process_index)
    others = None
    if args.process_index == 0 and settings.processes > 1:
        me = os.getpid()

        def argv_of(index: int) -> list[str]:
            argv = [sys.executable, "-m", "router", "-c", args.config]
            argv += ["--process-index", str(index), "--parent-pid", str(me)]
            return argv + ([] if args.port is None else ["--port", str(args.port)])

        others = RouterProcesses(argv_of, settings.processes)
        others.start()
    try:
        run_router(
            settings,
            log_level=cluster.log_level,
            on_server=others.watch_server if others is not None else None,
        )
    except KvserveError as e:
        print(f"router: {e}", file=sys.stderr)
        return 1
    finally:
        if others is not None:
            others.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
