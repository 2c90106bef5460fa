"""kvpool: the shared KV pool on Mooncake Store (DESIGN §4, §7).

    PoolClient (client.py)      lookups over every stage, stage reads/writes, breaker
      ├─ PoolKeys (keys.py)     object keys and chunk group ids of one namespace
      ├─ object_format.py       header + checksum of one (chunk, stage) object
      ├─ SlotBuffer (buffer.py) the registered buffer, cut into save and load slots
      └─ PoolBackend (backend.py): "mooncake" | "local" | "none"
    store.py / master.py        the pool's processes (`kvserve up` starts them)
    topology.py                 which master each process uses (shared / split pool)

Layer 3, beside the workers: knows bytes and layouts (protocol.KVLayout, layer ranges),
never models; it imports neither engine nor the workers.
"""

from kvpool.backend import BackendConfig, PoolBackend, backend_names, create_backend
from kvpool.client import PoolClient
from kvpool.errors import (
    BufferRegistrationError,
    KeyStatus,
    PoolConfigError,
    PoolError,
    PoolSetupError,
    PoolUnavailableError,
)
from kvpool.keys import PoolKeys, StageSpec, stages_of
from kvpool.metrics import PoolMetrics
from kvpool.object_format import ObjectSpec

__all__ = [
    "BackendConfig",
    "BufferRegistrationError",
    "KeyStatus",
    "ObjectSpec",
    "PoolBackend",
    "PoolClient",
    "PoolConfigError",
    "PoolError",
    "PoolKeys",
    "PoolMetrics",
    "PoolSetupError",
    "PoolUnavailableError",
    "StageSpec",
    "backend_names",
    "create_backend",
    "stages_of",
]
