"""A worker's caps, as passed on its command line by the launch wrapper.

The flag names and meanings are the seed's (vllm-mlx's), with one change that is the
point of the project: ``max_cache_blocks`` is the hard cap on the *global live KV pool*,
not a bound on a prefix store. The derived figures (allocation limit, trip) follow
DESIGN.md's two knobs with their two denominators.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from plimsoll.core.admission import trip_fraction
from plimsoll.core.model_facts import ModelFacts
from plimsoll.core.sizing import default_max_batch
from plimsoll.core.units import MIB
from plimsoll.engine.work import prefill_chunk_tokens


class WorkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: Path
    model_name: str
    max_cache_blocks: int = Field(gt=0, description="Hard cap on the global live KV pool.")
    #: u: the allocation cap is u × ceiling; the trip is min(u + offset, 0.99) × total RAM.
    gpu_memory_utilization: float = Field(gt=0, lt=1)
    cache_memory_mb: int = Field(ge=0, description="Prefix-cache cap, inside the pool (MiB).")
    max_num_seqs: int = Field(gt=0, description="The load-time worst case admission checked: "
                              "this many full-context sequences fit the pool at once.")
    max_batch: int | None = Field(default=None, gt=0, description=(
        "Sequences running at once (a runtime bound: short requests fit many more than "
        "max_num_seqs when their reservations fit); default max(64, max_num_seqs)."))
    prefill_chunk: int | None = Field(default=None, gt=0, description=(
        "Prompt tokens computed per step over all prefills, beside every running decode; "
        "None: PREFILL_CHUNK_FUSED where the backend's prefill attention is fused (a GPU), "
        "else PREFILL_CHUNK."))
    kv_dtype: Literal["float16", "bfloat16", "float32", "q8", "q4"] | None = Field(
        default=None, description="KV cache dtype; None: the model's; q8 / q4: quantized KV "
        "(8 / 4 bits in groups of 64, scales and biases in the model's dtype).")
    transient_bytes: int | None = Field(default=None, gt=0, description=(
        "The compute transient admission counted (the reserve less the MLX buffer cache): "
        "prefill chunks and decode batches stay under it. None: --prefill-chunk only."))
    block_bytes: int | None = Field(default=None, gt=0, description=(
        "Bytes per block admission counted; the worker refuses to start on another figure."))
    context: int = Field(gt=1, description="Configured total context per sequence.")
    block_tokens: int = Field(default=16, gt=0)
    max_tokens: int = Field(gt=0, description="Largest output reservation a request may ask.")
    default_max_tokens: int = Field(gt=0)
    max_queue: int = Field(default=64, ge=0)
    max_wait_s: float = Field(default=30.0, ge=0)
    ceiling_bytes: int = Field(gt=0)
    total_ram_bytes: int = Field(gt=0)
    trip_offset: float = 0.05
    mlx_cache_mb: int = Field(default=256, ge=0, description="MLX buffer-cache cap (MiB).")
    wired_limit_bytes: int = Field(default=0, ge=0, description="0: wire nothing.")
    disk_cache_dir: Path | None = Field(default=None, description=(
        "Directory of the disk tier for KV blocks leaving memory; None: no disk tier."))
    disk_cache_gb: float = Field(default=10.0, gt=0, description=(
        "Cap on the disk tier's files for this model, GiB."))
    host: str = "127.0.0.1"
    port: int = Field(default=8081, ge=0, le=65535)
    max_tokens_over_limit: Literal["clamp", "refuse"] = Field(
        default="clamp", description="A max_tokens over what fits: clamp it, or refuse (400).")
    drain_s: float = Field(default=30.0, ge=0, description="Seconds running requests may "
                           "finish after SIGTERM before they end with an error event.")
    quiet: bool = Field(default=False, description="No access-log line per request.")

    @property
    def batch_bound(self) -> int:
        return self.max_batch or default_max_batch(self.max_num_seqs)

    @property
    def allocation_limit_bytes(self) -> int:
        return math.floor(self.gpu_memory_utilization * self.ceiling_bytes)

    @property
    def trip_bytes(self) -> int:
        return math.floor(trip_fraction(self.gpu_memory_utilization, self.trip_offset)
                          * self.total_ram_bytes)

    @property
    def prefix_cache_bytes(self) -> int:
        return self.cache_memory_mb * MIB

    @property
    def disk_cache_bytes(self) -> int:
        return int(self.disk_cache_gb * (1 << 30))

    @property
    def mlx_cache_bytes(self) -> int:
        return self.mlx_cache_mb * MIB


#: The per-step prompt budget (``--prefill-chunk``) by default. On a CPU a chunk's compute
#: is what the running streams wait for, so it stays small. On a GPU every chunk at a prefix
#: costs a fixed ~40-55 ms of attention-plan build on MLX's CUDA backend (a new key length
#: each chunk; bench/results/cuda-attention-h200-2026-12-01.md), so bigger chunks, as mlx-lm's
#: 2048-token prefill steps, pay it for more tokens; a 2048 chunk delays streams ~0.1 s.
PREFILL_CHUNK = 512
PREFILL_CHUNK_FUSED = 2048


def default_prefill_chunk(fused: bool) -> int:
    return PREFILL_CHUNK_FUSED if fused else PREFILL_CHUNK


def prefill_chunk(facts: ModelFacts, context: int, transient_bytes: int | None, *,
                  block_tokens: int, most: int, fused: bool = False) -> int:
    """The prefill chunk at ``context`` whose transient (scores, activations and the gather
    of its table) stays within ``transient_bytes``: a multiple of the block, at most
    ``most``; 0 when not even one token fits. Admission (launch) and the worker both call
    this, so they agree on it. (The pool's growth transient comes before a step's
    compute, not during it, and is not counted here.)"""
    if transient_bytes is None:
        return most
    return prefill_chunk_tokens(facts, context, transient_bytes, multiple=block_tokens,
                                most=most, block_tokens=block_tokens, fused=fused)
