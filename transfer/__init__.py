"""Handoff: move a request's KV from prefill pages to decode pages (DESIGN §5 step 5).

    prefill (every stage, its own threads)              decode (every rank)
    paged KV --gather--> staging --Transport.write--> landing ring --scatter--> paged KV
             (kv_pack)  slots (HandoffSender) ops <= 8 MiB (LandingArena,    (reserved
                                                           ring.py)          at admit)
    flow control: decode answers each SegmentsLanded after its scatter; the sender reuses
    those ring bytes only then (transfer/ring.py)

Layer 2: imports protocol and torch only. Importing the package registers every transport
("local", "mooncake", "cuda_ipc"); Mooncake itself is imported only when a mooncake
transport is made, CUDA is touched only when a cuda_ipc transport is made.
"""

from transfer.cuda_ipc import CudaIpcTransport
from transfer.errors import (
    LandingError,
    PackLayoutError,
    TransferError,
    TransportConfigError,
)
from transfer.faults import HandoffFaults
from transfer.flows import FlowCoverage, rank_landing_bytes, shard_of
from transfer.kv_pack import FULL, KVShard, gather, packed_nbytes, packed_view, scatter
from transfer.landing import LandingArena, LandingRegion, scatter_segments
from transfer.local import LocalFabric, LocalTransport
from transfer.mooncake_te import MooncakeTransport
from transfer.ring import RingSpace, stage_ring
from transfer.send_state import SendResult
from transfer.sender import HandoffSender
from transfer.transport import (
    MAX_OP_BYTES,
    Transport,
    TransportConfig,
    WriteOp,
    WriteStats,
    create_transport,
    expected_num_ops,
    handoff_transport_config,
    transport_names,
)

__all__ = [
    "FULL",
    "MAX_OP_BYTES",
    "CudaIpcTransport",
    "FlowCoverage",
    "HandoffFaults",
    "HandoffSender",
    "KVShard",
    "LandingArena",
    "LandingError",
    "LandingRegion",
    "LocalFabric",
    "LocalTransport",
    "MooncakeTransport",
    "PackLayoutError",
    "RingSpace",
    "SendResult",
    "TransferError",
    "Transport",
    "TransportConfig",
    "TransportConfigError",
    "WriteOp",
    "WriteStats",
    "create_transport",
    "expected_num_ops",
    "gather",
    "handoff_transport_config",
    "packed_nbytes",
    "packed_view",
    "rank_landing_bytes",
    "scatter",
    "scatter_segments",
    "shard_of",
    "stage_ring",
    "transport_names",
]
