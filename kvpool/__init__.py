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

Nothing is imported here: the launcher and the pool's processes import torch-free
modules (topology, master, store, backend), the prefill worker imports kvpool.client.
"""
