"""The instance sections of cluster.yaml: prefill (PP stages), decode (TP x DCP ranks) and
unified instances, with their handoff transport and the test-only fault injections.
Torch-free."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from protocol.cluster_types import (
    ByteSize,
    Device,
    Name,
    Port,
    PositiveInt,
    Section,
    device_name,
)

HandoffProtocol = Literal["tcp", "rdma", "cuda_ipc"]
MiB = 1024**2


class HandoffFaultsConfig(Section, frozen=True, kw_only=True):
    """Injected handoff faults, for tests of the failure paths only (transfer/faults.py):
    never set them in a real deployment."""

    fail_prompt_tokens: PositiveInt | None = None
    """Fail the KV writes of every request with exactly this many prompt tokens, after
    its first piece (a transfer failed mid-flight)."""
    write_delay_s: Annotated[float, msgspec.Meta(ge=0, le=10)] = 0.0
    """Sleep before every KV write (a slow transport)."""
    hold_prompt_tokens: PositiveInt | None = None
    """Hold every request with exactly this many prompt tokens at prefill's door (before
    its engine) until `hold_until_file` exists (at most 300 s): a request queued in
    prefill while its decode dies."""
    hold_until_file: str | None = None


class EngineFaultsConfig(Section, frozen=True, kw_only=True):
    """Injected per-request engine faults, for tests of a failing request only
    (engine/faults.py): never set them in a real deployment."""

    fail_seed: int
    """Every step holding a request with this sampling seed fails at `place`."""
    place: Literal["sample", "forward"] = "sample"
    """"sample": the batched sampler raises; "forward": the batched model forward raises."""
    stage: int | None = None
    """"forward" on a prefill pipeline: the one stage whose forward raises (None: each)."""
    rank: int | None = None
    """"forward" on a decode TP x DCP instance: the one rank that raises, inside its
    forward before layer `layer` (the others do not: a failure of that rank's device or
    memory); None: every rank alike, before the forward (what a request's input does)."""
    layer: int = 0
    hang_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    """> 0: the poisoned step sleeps this long instead of raising (a step that does not
    return), at "sample" or at a single-process "forward"; the stall watchdog's tests."""


class PrefillConfig(Section, frozen=True, kw_only=True):
    """One prefill instance: PP stages, one process per device."""

    name: Name
    node: str
    port: Port
    """HTTP port of the instance (serving path, /health, /status, /metrics)."""
    devices: tuple[Device, ...]
    """One device per pipeline stage: GPU indices [0, 1, 2, 3], "cuda:N", or "cpu"."""
    pipeline_parallel: PositiveInt = 1
    layer_split: tuple[PositiveInt, ...] | None = None
    """Layers per stage, e.g. [20, 20, 20, 18]; None: as even as possible. Length must be
    pipeline_parallel; the sum must equal the model's layer count (checked at start)."""
    max_batched_tokens: PositiveInt = 2048
    """Token budget of one forward step (chunked prefill)."""
    max_num_seqs: PositiveInt = 256
    """Requests scheduled at once."""
    landing_wait_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0
    """How long a request sent beside decode's (PrefillRequest.await_landing) keeps its
    computed KV waiting for decode's landing (LandingGrant), from its arrival; then the KV
    is freed and a later grant answered 410."""
    kv_cache_memory: ByteSize = ByteSize(512 * MiB)
    """Paged KV cache per device (GPU prefix cache)."""
    pool_buffer_memory: ByteSize = ByteSize(256 * MiB)
    """Buffer per device registered with the pool for zero-copy save/restore (pool only;
    pinned host memory, not part of the GPU budget)."""
    gpu_memory_budget: ByteSize | None = None
    """GPU memory one stage process may use; None: derived (weights + kv_cache_memory +
    handoff staging + workspace, protocol/device_budget.py). Checked when GPUs are shared."""
    dist_port: Port | None = None
    """torch.distributed rendezvous port of the stage processes; None: picked at start."""
    metrics_port: Port | None = None
    """Separate Prometheus port; None: /metrics on `port`."""
    env: dict[str, str] = msgspec.field(default_factory=dict)
    """Extra environment for the instance's processes (e.g. NCCL_DEBUG)."""
    handoff_faults: HandoffFaultsConfig | None = None
    """Test-only fault injection into this instance's KV handoff (None: off)."""
    engine_faults: EngineFaultsConfig | None = None
    """Test-only per-request fault injection into this instance's engine (None: off)."""

    @property
    def device_names(self) -> tuple[str, ...]:
        """Torch device strings, one per stage."""
        return tuple(device_name(d) or str(d) for d in self.devices)


class TransferConfig(Section, frozen=True, kw_only=True):
    """How KV reaches a decode instance from prefill (the handoff)."""

    protocol: HandoffProtocol = "tcp"
    """Mooncake Transfer Engine over "tcp" or "rdma" (any hosts), or "cuda_ipc": GPU to GPU
    between processes of one host (every prefill and this decode on GPUs of its node; the
    landing buffer lives on the decode GPU)."""
    port: Port | None = None
    """Transfer engine port of rank 0 (rank r uses port + r); None: picked at start."""
    rdma_devices: tuple[str, ...] = ()
    """RDMA NICs to use (protocol rdma only); empty: all."""


class DecodeConfig(Section, frozen=True, kw_only=True):
    """One decode instance: tensor_parallel ranks, one process per device."""

    name: Name
    node: str
    port: Port
    """HTTP port of the instance (serving path, /health, /status, /metrics)."""
    devices: tuple[Device, ...]
    """One device per TP rank."""
    tensor_parallel: PositiveInt = 1
    decode_context_parallel: PositiveInt = 1
    """Ranks a head group's tokens are striped over (t mod DCP); must divide
    tensor_parallel."""
    kv_cache_memory: ByteSize = ByteSize(512 * MiB)
    """Paged KV cache per device."""
    landing_memory: ByteSize = ByteSize(256 * MiB)
    """Registered buffer per device that handoff writes land in before the scatter. A
    request's region is at most `landing_region` (transfer/landing.py): longer prompts
    stream through the region as a ring, so any context length is served."""
    landing_region: ByteSize | None = None
    """The largest landing region one request holds; None: a quarter of landing_memory.
    A request holds its region from /decode until its prompt has landed (its prefill
    included), and a /decode that finds no room waits before prefill is called, so
    landing_memory / landing_region is how many requests can be between admission and
    decoding at once; a smaller region streams a long prompt in more passes (one decode
    round trip each)."""
    transfer: TransferConfig = TransferConfig()
    gpu_memory_budget: ByteSize | None = None
    """GPU memory one rank process may use; None: derived (weights + kv_cache_memory +
    landing_memory when it is on the GPU + workspace, protocol/device_budget.py)."""
    max_num_seqs: PositiveInt = 256
    """Requests decoded at once (continuous batching)."""
    dist_port: Port | None = None
    """torch.distributed rendezvous port of the rank processes; None: picked at start."""
    metrics_port: Port | None = None
    """Separate Prometheus port; None: /metrics on `port`."""
    env: dict[str, str] = msgspec.field(default_factory=dict)
    """Extra environment for the instance's processes."""
    engine_faults: EngineFaultsConfig | None = None
    """Test-only per-request fault injection into this instance's engine (None: off)."""

    @property
    def device_names(self) -> tuple[str, ...]:
        """Torch device strings, one per rank."""
        return tuple(device_name(d) or str(d) for d in self.devices)


class UnifiedConfig(Section, frozen=True, kw_only=True):
    """One unified instance: a single engine process that prefills and decodes (chunked
    prefill and decodes mixed in one step, as one vLLM server does), with no handoff. It
    restores history from the pool and saves every full chunk to it exactly as a prefill
    instance does; the router sends it a request in one call. The topology for a small
    box, where a second process would compete for the same cores (docs/architecture.md,
    "Topologies"). One device; pipeline and tensor parallel layouts are P/D only."""

    name: Name
    node: str
    port: Port
    """HTTP port of the instance (serving path, /health, /status, /metrics)."""
    devices: tuple[Device, ...]
    """Exactly one device: a GPU index, "cuda:N", or "cpu"."""
    max_batched_tokens: PositiveInt = 2048
    """Token budget of one forward step: decodes first, prefill chunks fill the rest."""
    max_num_seqs: PositiveInt = 256
    """Requests scheduled at once (prefilling and decoding together)."""
    kv_cache_memory: ByteSize = ByteSize(512 * MiB)
    """Paged KV cache of the device: the prefix cache and every running request's KV."""
    pool_buffer_memory: ByteSize = ByteSize(256 * MiB)
    """Buffer registered with the pool for zero-copy save/restore (pool only)."""
    gpu_memory_budget: ByteSize | None = None
    """GPU memory the process may use; None: derived (weights + kv_cache_memory +
    workspace, protocol/device_budget.py). Checked when GPUs are shared."""
    metrics_port: Port | None = None
    """Separate Prometheus port; None: /metrics on `port`."""
    env: dict[str, str] = msgspec.field(default_factory=dict)
    """Extra environment for the instance's process."""
    engine_faults: EngineFaultsConfig | None = None
    """Test-only per-request fault injection into this instance's engine (None: off)."""

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(device_name(d) or str(d) for d in self.devices)

    # What the prefill worker's pool pieces read of an instance (one stage, whole model).
    @property
    def pipeline_parallel(self) -> int:
        return 1

    @property
    def layer_split(self) -> tuple[int, ...] | None:
        return None

    @property
    def dist_port(self) -> int | None:
        return None


Instance = PrefillConfig | DecodeConfig | UnifiedConfig
PoolInstance = PrefillConfig | UnifiedConfig
"""An instance that restores from and saves to the pool (prefill and unified)."""
