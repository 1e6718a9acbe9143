"""The worker's contract: every setting ``plimsoll worker`` takes, declared once.

:class:`WorkerConfig` is the one declaration of each setting: its name, type, bounds,
default and help. Launch writes a worker's command line from it (:func:`worker_flags`), and
``plimsoll worker`` generates its click options from it (:data:`SETTINGS`, read by
:mod:`plimsoll.cli.worker`), so adding a setting here adds it to both. A setting's flag is
``--`` and its name with dashes unless its :class:`Flag` says otherwise.

``max_cache_blocks`` is the hard cap on the *global live KV pool* (live sequences and the
prefix cache together), not a bound on a prefix store. The derived figures (allocation
limit, trip) follow the two knobs with their two denominators (docs/DESIGN.md, "The
arithmetic").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from plimsoll.core.admission import trip_fraction
from plimsoll.core.sizing import DEFAULT_OUTPUT_TOKENS, default_max_batch
from plimsoll.core.transients import PREFILL_CHUNK, PREFILL_CHUNK_FUSED
from plimsoll.core.units import MIB


@dataclass(frozen=True)
class Alias:
    """A second spelling of a setting whose values map onto the setting's own."""

    flag: str
    values: dict[str, str]
    help: str


@dataclass(frozen=True)
class Flag:
    """How a setting is spelled on the command line, where not by its name.

    ``flag``: the spelling (default ``--`` + the name with dashes). ``filled``: required in
    the configuration, but ``plimsoll worker`` may be started without it and fills it (its
    help says from what). ``existing``: a directory that must exist. ``alias``: another
    spelling that sets it too.
    """

    flag: str | None = None
    filled: bool = False
    existing: bool = False
    alias: Alias | None = None


KvDtype = Literal["float16", "bfloat16", "float32", "q8", "q4"]


class WorkerConfig(BaseModel):
    """A worker's caps, as launch passes them on its command line."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: Annotated[Path, Flag("--model", existing=True)] = Field(
        description="Local model directory (mlx-lm layout).")
    model_name: Annotated[str, Flag(filled=True)] = Field(
        description="Name clients use (default: the directory's name).")
    max_cache_blocks: int = Field(gt=0, description=(
        "Hard cap on the global live KV pool, in blocks (all sequences + prefixes)."))
    #: u: the allocation cap is u × ceiling; the trip is min(u + offset, 0.99) × total RAM.
    gpu_memory_utilization: float = Field(gt=0, lt=1, description=(
        "u: MLX allocation cap = u × ceiling; trip = min(u + 0.05, 0.99) × RAM."))
    cache_memory_mb: int = Field(default=0, ge=0, description=(
        "Cap on the prefix cache, which lives inside the pool (MiB)."))
    max_num_seqs: int = Field(gt=0, description=(
        "Full-context sequences admission fitted in the pool at once (the load-time worst "
        "case; launch verifies it)."))
    max_batch: int | None = Field(default=None, gt=0, description=(
        "Sequences running at once, a runtime bound of its own: shorter requests fit many "
        "more than --max-num-seqs when their reservations fit "
        "[default: max(64, --max-num-seqs)]."))
    prefill_chunk: int | None = Field(default=None, gt=0, description=(
        "Prompt tokens computed per step over all prefills, beside every running decode: a "
        "long prompt delays running streams by at most this chunk per step "
        f"[default: {PREFILL_CHUNK_FUSED} on a GPU (fused prefill attention), "
        f"{PREFILL_CHUNK} on a CPU]."))
    kv_dtype: Annotated[KvDtype | None, Flag(alias=Alias(
        "--kv-bits", {"8": "q8", "4": "q4"},
        "Quantized KV, as mlx_lm's --kv-bits: the same as --kv-dtype q8 / q4."))] = Field(
        default=None, description=(
            "KV cache dtype (default: the model's); q8 / q4: quantized KV, 8 / 4 bits in "
            "groups of 64 (mlx-lm's QuantizedKVCache format, scales and biases in the "
            "model's dtype), batched."))
    transient_bytes: int | None = Field(default=None, gt=0, description=(
        "Compute transient admission counted (its reserve less the MLX buffer cache): the "
        "prefill chunk follows the context to stay under it, and a decode batch grows only "
        "while it does [default: unbounded; --prefill-chunk only]."))
    block_bytes: int | None = Field(default=None, gt=0, description=(
        "Bytes per KV block admission counted: the worker refuses to start if the loaded "
        "engine's blocks differ (launch passes it)."))
    context: int = Field(gt=1, description=(
        "Configured total context per sequence (prompt + output)."))
    block_tokens: int = Field(default=16, gt=0, description="Tokens per KV block.")
    max_tokens: Annotated[int, Flag(filled=True)] = Field(gt=0, description=(
        "Largest output reservation a request may ask [default: a quarter of --context]."))
    default_max_tokens: Annotated[int, Flag(filled=True)] = Field(gt=0, description=(
        "Output reservation when a request names none "
        f"[default: {DEFAULT_OUTPUT_TOKENS}, at most --max-tokens]."))
    max_queue: int = Field(default=64, ge=0, description=(
        "Requests that may wait for blocks; beyond it: 503."))
    max_wait_s: Annotated[float, Flag("--max-wait")] = Field(default=30.0, ge=0, description=(
        "Seconds a request may wait for blocks before a 503."))
    ceiling_bytes: Annotated[int, Flag(filled=True)] = Field(gt=0, description=(
        "The ceiling admission used (default: the live probe)."))
    total_ram_bytes: Annotated[int, Flag(filled=True)] = Field(gt=0, description=(
        "Total RAM admission used (default: the live probe)."))
    trip_offset: float = Field(default=0.05, ge=0, le=0.5, description=(
        "The trip's offset above u: trip = min(u + offset, 0.99) × RAM."))
    mlx_cache_mb: int = Field(default=256, ge=0, description=(
        "Cap on MLX's buffer cache (mx.set_cache_limit), MiB."))
    wired_limit_bytes: int = Field(default=0, ge=0, description=(
        "What to wire (Metal only): 0 wires nothing."))
    disk_cache_dir: Path | None = Field(default=None, description=(
        "Keep KV blocks leaving memory (eviction, the trip's clear, shutdown) in this "
        "directory and read them back for prompts that match [default: off]."))
    disk_cache_gb: float = Field(default=10.0, gt=0, description=(
        "Cap on the disk tier's files for this model, GiB."))
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8081, ge=0, le=65535, description="Port to listen on.")
    max_tokens_over_limit: Literal["clamp", "refuse"] = Field(default="clamp", description=(
        "A request's max_tokens over --max-tokens or what the context leaves: clamp it (the "
        "applied figure is sent in x-plimsoll-max-tokens) or refuse it with a 400."))
    drain_s: Annotated[float, Flag("--drain-timeout")] = Field(default=30.0, ge=0, description=(
        "Seconds running requests may finish after SIGTERM; then they end with the "
        "protocol's error event."))
    quiet: bool = Field(default=False, description="No access-log line per request.")
    prompt_lookup: int = Field(default=0, ge=0, le=8, description=(
        "Speculate by prompt lookup: draft the tokens that followed the last N tokens' (N "
        "down to 1) latest earlier occurrence in the prompt and output, verified in the "
        "batch's one forward; unconstrained requests only, greedy or sampled; 0: off."))
    mtp: bool = Field(default=True, description=(
        "Speculate with the checkpoint's MTP head where it has one (num_nextn_predict_layers "
        "> 0 and its tensors present, as GLM-4.x and DeepSeek-V3 ship them; mlx conversions "
        "drop them): the head drafts for every sequence as one batch on its own paged KV, "
        "verified in the batch's one forward; --draft-model wins over it, --prompt-lookup is "
        "the fallback; --no-mtp: off. Admission counts the head (its weights and one layer's "
        "KV a block); the worker drops one that does not fit beside its pool."))
    compile_decode: bool = Field(default=False, description=(
        "Compile decode-only steps per shape bucket (mx.compile; plain full-attention "
        "models only, at most 24 buckets): less host time per step; off by default until a "
        "GPU run shows the whole step faster."))
    num_draft_tokens: int = Field(default=3, gt=0, le=16, description=(
        "Most tokens drafted per sequence and step (each sequence's draft length adapts "
        "to its acceptance, down to 0)."))
    draft_model: Path | None = Field(default=None, description=(
        "Speculate with this draft model (DIR|ORG/NAME, resolved as --model; never "
        "downloaded): a smaller model of the same vocabulary drafts greedily on its own "
        "bounded paged KV (a block for every block of the pool), verified in the batch's one "
        "forward; greedy, unconstrained requests only; wins over --prompt-lookup."))

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


@dataclass(frozen=True)
class Setting:
    """One :class:`WorkerConfig` field with its command-line spelling."""

    name: str
    info: FieldInfo
    spelling: Flag = field(default_factory=Flag)

    @property
    def flag(self) -> str:
        return self.spelling.flag or "--" + self.name.replace("_", "-")

    @property
    def no_flag(self) -> str:
        """A boolean setting's spelling that turns it off (``--no-`` and its name)."""
        return "--no-" + self.flag[2:]


def _settings() -> tuple[Setting, ...]:
    out = []
    for name, info in WorkerConfig.model_fields.items():
        spelling = next((m for m in info.metadata if isinstance(m, Flag)), Flag())
        out.append(Setting(name, info, spelling))
    return tuple(out)


#: Every setting, in declaration order (the order of ``plimsoll worker --help``).
SETTINGS = _settings()


def worker_flags(cfg: WorkerConfig) -> list[str]:
    """``cfg`` as ``plimsoll worker``'s flags: every setting that has a value, explicitly."""
    out: list[str] = []
    for s in SETTINGS:
        value = getattr(cfg, s.name)
        if value is None:
            continue
        if isinstance(value, bool):  # one on by default is turned off by its --no- flag
            if value or s.info.default:
                out.append(s.flag if value else s.no_flag)
            continue
        out += [s.flag, repr(value) if isinstance(value, float) else str(value)]
    return out
