"""Distinct id types, so a block id is never passed where a block hash is expected."""

from __future__ import annotations

from typing import NewType

RequestId = NewType("RequestId", str)
"""Globally unique id of one request (router-assigned)."""

BlockId = NewType("BlockId", int)
"""Index of a physical block in one instance's paged KV cache."""

BlockHash = NewType("BlockHash", bytes)
"""16-byte chain hash of a full token block: identifies its content and whole prefix."""

ChunkKey = NewType("ChunkKey", bytes)
"""Pool key of a 256-token chunk: the chain hash of the chunk's last block."""

SlotId = NewType("SlotId", int)
"""Flat index of one token's KV in the paged cache: block_id * block_size + offset."""
