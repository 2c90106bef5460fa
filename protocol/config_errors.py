"""The error every configuration problem raises (cluster.yaml, component configs)."""

from __future__ import annotations

from protocol.errors import KvserveError


class ConfigError(KvserveError):
    """A configuration file or value is invalid.

    `path` names the offending key the way a user finds it in the YAML file
    (`decode[0].tensor_parallel`, empty for the file as a whole); the message says what is
    wrong and what would be valid.
    """

    def __init__(self, path: str, message: str, source: str | None = None) -> None:
        self.path = path
        self.message = message
        self.source = source
        where = f"{source}: " if source else ""
        key = f"{path}: " if path else ""
        super().__init__(f"{where}{key}{message}")
