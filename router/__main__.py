"""`python -m router -c cluster.yaml`: run the router section of a cluster (what the
kvserve launcher starts)."""

from __future__ import annotations

import argparse
import logging
import sys

import msgspec

from protocol.cluster import load_cluster
from protocol.config_errors import ConfigError
from protocol.errors import KvserveError
from protocol.internal_auth import SECRET_ENV, secret_from_env
from router.config import settings_from_cluster
from router.server import run_router


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    parser.add_argument("-c", "--config", required=True, help="cluster.yaml")
    parser.add_argument("--port", type=int, default=None, help="override router.port")
    args = parser.parse_args(argv)
    try:
        cluster = load_cluster(args.config)
        settings = settings_from_cluster(cluster)
    except (ConfigError, ValueError) as e:
        print(f"router: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cluster.log_level.upper(),
        format="%(asctime)s %(levelname)s router %(name)s: %(message)s",
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
    try:
        run_router(settings, log_level=cluster.log_level)
    except KvserveError as e:
        print(f"router: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
