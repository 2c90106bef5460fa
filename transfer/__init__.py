"""Handoff: move a request's KV from prefill pages to decode pages (DESIGN §5 step 5).

    prefill                                             decode
    paged KV --gather--> staging --Transport.write--> landing region --scatter--> paged KV
             (kv_pack)   (HandoffSender)  ops <= 8 MiB  (LandingArena)  (scatter_segments)

Layer 2: imports protocol and torch only. Importing the package registers every transport
("local", "mooncake"); Mooncake itself is imported only when a mooncake transport is made.
"""

from transfer.errors import (
    LandingError,
    LandingTooLargeError,
    PackLayoutError,
    TransferError,
    TransportConfigError,
)
from transfer.flows import check_flows, flow_offset, rank_landing_bytes, send_flows, shard_of
from transfer.kv_pack import FULL, KVShard, gather, packed_nbytes, packed_view, scatter
from transfer.landing import LandingArena, LandingRegion, scatter_segments
from transfer.local import LocalFabric, LocalTransport
from transfer.mooncake_te import MooncakeTransport
from transfer.sender import HandoffSender
from transfer.transport import (
    MAX_OP_BYTES,
    Transport,
    TransportConfig,
    WriteOp,
    WriteStats,
    create_transport,
    expected_num_ops,
    transport_names,
)

__all__ = [
    "FULL",
    "MAX_OP_BYTES",
    "HandoffSender",
    "KVShard",
    "LandingArena",
    "LandingError",
    "LandingRegion",
    "LandingTooLargeError",
    "LocalFabric",
    "LocalTransport",
    "MooncakeTransport",
    "PackLayoutError",
    "TransferError",
    "Transport",
    "TransportConfig",
    "TransportConfigError",
    "WriteOp",
    "WriteStats",
    "check_flows",
    "create_transport",
    "expected_num_ops",
    "flow_offset",
    "gather",
    "packed_nbytes",
    "packed_view",
    "rank_landing_bytes",
    "scatter",
    "scatter_segments",
    "send_flows",
    "shard_of",
    "transport_names",
]
