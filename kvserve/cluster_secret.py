"""The cluster secret on this host: where `kvserve up` gets it, where the CLI finds it.

    auth.secret_file  read the file (mode 0600 or stricter, at least 32 characters)
    auth.secret_env   read the environment variable (set on every host)
    neither           `kvserve up` writes a fresh random secret to
                      <state dir>/<cluster>/cluster_secret (0600) for this run

The launcher hands it to the router and the workers in their environment
(protocol/internal_auth.py SECRET_ENV), never on a command line, which `ps` shows.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvserve.run_state import RunDir
from protocol.cluster import ClusterConfig
from protocol.config_errors import ConfigError
from protocol.internal_auth import new_secret, secret_problem

SECRET_FILE = "cluster_secret"


def configured_secret(cluster: ClusterConfig) -> str | None:
    """The secret cluster.yaml names (file or variable), None when it names none.
    ConfigError naming the key when the named source is unusable on this host."""
    a = cluster.auth
    if a.secret_file is not None:
        return _read_secret_file(Path(a.secret_file).expanduser(), "auth.secret_file")
    if a.secret_env is not None:
        value = os.environ.get(a.secret_env, "").strip()
        if not value:
            raise ConfigError(
                "auth.secret_env",
                f"names {a.secret_env!r} but that environment variable is unset or empty "
                "on this host; set it (to the same value on every host) or remove secret_env",
            )
        problem = secret_problem(value)
        if problem:
            raise ConfigError("auth.secret_env", f"${a.secret_env} is unusable: {problem}")
        return value
    return None


def secret_for_launch(cluster: ClusterConfig, run: RunDir) -> str:
    """The secret of a run about to start: the configured one, or a new random one
    written to the run directory (0600) for the CLI's calls to the workers."""
    configured = configured_secret(cluster)
    if configured is not None:
        return configured
    secret = new_secret()
    run.root.mkdir(parents=True, exist_ok=True)
    path = run.root / SECRET_FILE
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    tmp.replace(path)
    return secret


def secret_for_client(cluster: ClusterConfig, run: RunDir) -> str | None:
    """The secret the CLI sends to a running cluster's workers (None when unknown here)."""
    try:
        configured = configured_secret(cluster)
    except ConfigError:
        return None
    if configured is not None:
        return configured
    try:
        return (run.root / SECRET_FILE).read_text().strip() or None
    except OSError:
        return None


def describe_secret_source(cluster: ClusterConfig) -> str:
    """One line for `kvserve check`; ConfigError when the named source is unusable."""
    a = cluster.auth
    configured_secret(cluster)
    if a.secret_file is not None:
        where = f"file {a.secret_file}"
    elif a.secret_env is not None:
        where = f"${a.secret_env}"
    else:
        where = f"a random one per run (<state dir>/{cluster.name}/{SECRET_FILE}, 0600)"
    return (
        f"  auth     cluster secret: {where}; internal calls carry it, workers answer "
        "401 without it (/health and /metrics stay open)"
    )


def _read_secret_file(path: Path, key: str) -> str:
    try:
        st = path.stat()
        value = path.read_text().strip()
    except OSError as e:
        raise ConfigError(key, f"cannot read {path}: {e.strerror or e}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            key,
            f"{path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run: chmod 600 {path}",
        )
    problem = secret_problem(value)
    if problem:
        raise ConfigError(key, f"{path} is unusable: {problem}")
    return value
