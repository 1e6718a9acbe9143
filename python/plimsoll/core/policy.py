"""The host policy: the one file Nix generates and every runtime piece reads.

Why pydantic models and a committed JSON Schema: the schema is the contract between
the Nix modules (which write the file) and Python (which reads it). The schema is
generated from these models (``plimsoll policy schema``) and a test fails when the
committed copy drifts from them.

Units: every ``…Gb`` field is GiB (``× 1024³``), as in docs/DESIGN.md; fractions are
fractions of the mode's budget. Field names in the file are camelCase (Nix style).

Invariants checked here (each error names the field):
- each mode's budget leaves the OS floor free: ``totalRamGb − maxLocalLlmGb ≥ osFloorGb``;
- the clustered budget is at least the standalone one (and is the standalone one when the
  file leaves it out);
- every model's output reservation fits its context.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from .policy_errors import PolicyError, schema_errors, validation_message
from .sizing import DEFAULT_OUTPUT_TOKENS, default_output
from .units import gib_to_bytes

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("policy.schema.json")

Mode = Literal["standalone", "clustered"]
KvDtype = Literal["auto", "float16", "bfloat16", "float32", "q8", "q4"]
WireChoice = Literal["footprint", "weights", "none"]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class _Strict(BaseModel):
    """Frozen, unknown keys rejected, camelCase in the file, snake_case in Python."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,  # Infinity/NaN parse as JSON in Python; no budget is infinite
        alias_generator=to_camel,
        populate_by_name=True,
    )


class ModeBudget(_Strict):
    max_local_llm_gb: float = Field(
        gt=0, description="GiB this mode may give to local LLM workers (weights + KV + reserve)."
    )

    @model_validator(mode="after")
    def _at_least_a_mebibyte(self) -> ModeBudget:
        """A positive budget that rounds to (almost) no bytes is a typo, not a budget."""
        if self.max_local_llm_gb < 1 / 1024:
            raise ValueError(
                f"maxLocalLlmGb ({self.max_local_llm_gb:g} GiB) is below 1 MiB: budgets are "
                "GiB (e.g. 72 for 72 GiB); raise it"
            )
        return self


class Modes(_Strict):
    """``clustered`` may be left out (a host that never joins a cluster): it is then the
    standalone budget."""

    standalone: ModeBudget
    clustered: ModeBudget = Field(
        default=None, description="GiB while the cluster link is up; default: the standalone "
        "budget.")

    @model_validator(mode="before")
    @classmethod
    def _clustered_defaults_to_standalone(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("clustered") is None and "standalone" in data:
            data = {**data, "clustered": data["standalone"]}
        return data

    @model_validator(mode="after")
    def _clustered_not_below_standalone(self) -> Modes:
        s, c = self.standalone.max_local_llm_gb, self.clustered.max_local_llm_gb
        if c < s:
            raise ValueError(
                f"modes.clustered.maxLocalLlmGb ({c:g} GiB) is below "
                f"modes.standalone.maxLocalLlmGb ({s:g} GiB): raise the clustered budget "
                "or lower the standalone one"
            )
        return self


class DiskCache(_Strict):
    """The disk tier for KV blocks leaving memory (written there, read back for prompts
    that match instead of prefilling them). Off when absent."""

    path: str = Field(min_length=1, description="Directory of the tier's files (~ expands).")
    max_gb: float = Field(
        default=10, gt=0, le=65536, description="Cap on the tier's files per model, GiB."
    )


class ModelEntry(_Strict):
    path: str = Field(
        min_length=1, description="Local model directory (config.json + safetensors)."
    )
    context: int = Field(
        ge=256, le=4_194_304, description="Configured total context (prompt + output) in tokens."
    )
    concurrency: int = Field(
        default=1, ge=1, le=1024, description="Requested concurrent sequences."
    )
    default_max_tokens: int = Field(
        default=DEFAULT_OUTPUT_TOKENS, ge=1,
        description="Output reservation when a request names none (at most maxTokens).",
    )
    max_tokens: int = Field(default=4096, ge=1, description="Largest output reservation allowed.")
    max_tokens_over_limit: Literal["clamp", "refuse"] = Field(
        default="clamp",
        description="A request's max_tokens over maxTokens or what the context leaves after "
        "its prompt: clamp it (the answer ends with length / max_tokens if reached) or "
        "refuse it with a 400.",
    )
    kv_dtype: KvDtype = Field(default="auto", description=(
        "KV cache dtype; auto = the model's; q8 / q4 = quantized KV (8 / 4 bits in groups of 64, "
        "scales and biases in the model's dtype)."))
    sharded: bool = Field(
        default=False, description="Serve sharded across the cluster (clustered mode)."
    )
    idle_ttl_s: float = Field(
        default=300, ge=0, description="Unload the idle worker after this many seconds (0: never)."
    )
    disk_cache: DiskCache | None = Field(
        default=None, description="This model's disk tier (default: the host's diskCache)."
    )
    prompt_lookup: int = Field(default=0, ge=0, le=8, description=(
        "Speculate by prompt lookup, matching the last N tokens (N down to 1) against the "
        "prompt and output (the worker's --prompt-lookup); 0: off."))
    num_draft_tokens: int = Field(default=3, ge=1, le=16, description=(
        "Most tokens drafted per sequence and step (the worker's --num-draft-tokens)."))
    mtp: bool = Field(default=True, description=(
        "Speculate with the checkpoint's MTP head where it has one (the worker's --mtp / "
        "--no-mtp; its weights and one layer's KV counted by admission); a draftModel wins "
        "over it."))
    draft_model: str | None = Field(default=None, min_length=1, description=(
        "Speculate with this draft model (a local directory, or ORG/NAME in the local "
        "Hugging Face cache; the worker's --draft-model): a smaller model of the same "
        "vocabulary, its weights and KV counted by admission; wins over promptLookup."))

    @model_validator(mode="before")
    @classmethod
    def _default_within_max(cls, data: Any) -> Any:
        """An omitted defaultMaxTokens never exceeds an explicit, smaller maxTokens."""
        max_tokens = data.get("maxTokens") if isinstance(data, dict) else None
        if isinstance(max_tokens, int) and "defaultMaxTokens" not in data:
            data = {**data, "defaultMaxTokens": default_output(max_tokens)}
        return data

    @model_validator(mode="after")
    def _reservations_fit(self) -> ModelEntry:
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(
                f"defaultMaxTokens ({self.default_max_tokens}) exceeds maxTokens "
                f"({self.max_tokens}): lower defaultMaxTokens"
            )
        if self.max_tokens >= self.context:
            raise ValueError(
                f"maxTokens ({self.max_tokens}) must be below context ({self.context}) so a "
                "prompt fits beside the output reservation: lower maxTokens or raise context"
            )
        return self


class Listen(_Strict):
    host: str = Field(default="127.0.0.1", description="Proxy bind address (loopback by default).")
    port: int = Field(default=8080, ge=1, le=65535)


class Peer(_Strict):
    host: Name
    address: str = Field(min_length=1, description="Peer address on the cluster link.")


#: MLX's distributed backends a cluster may run on; "auto" takes the first MLX reports
#: available on the host, in :data:`plimsoll.cluster.backend.PREFERENCE` order (ring last).
ClusterBackend = Literal["auto", "ring", "jaccl", "nccl"]


class Cluster(_Strict):
    interface: str = Field(default="bridge0", min_length=1, description="Cluster link interface.")
    peers: tuple[Peer, ...] = ()
    backend: ClusterBackend = Field(
        default="auto",
        description="MLX distributed backend of a sharded model's ranks: ring (TCP, e.g. the "
        "Thunderbolt bridge), jaccl (RDMA over Thunderbolt 5, macOS 26.2+ with RDMA enabled), "
        "nccl (NVIDIA GPUs), or auto (what MLX reports available here; ring last).",
    )


class Pressure(_Strict):
    """The proxy-wide memory-pressure tripwire: a backstop behind admission, not a substitute.

    warn: new requests and loads get 503 ``memory_pressure`` and requests waiting for a load
    are cancelled; critical: also unload idle workers, then the least recently used ones,
    one per poll, until the level drops. Admission reopens only after ``clearAfterS`` of
    readings under every line.
    """

    enabled: bool = Field(default=True, description="Run the tripwire in the proxy.")
    some_avg10_warn: float = Field(
        default=10, gt=0, le=100,
        description="Linux PSI memory 'some avg10' (% of time stalled) that stops admission.",
    )
    some_avg10_critical: float = Field(
        default=25, gt=0, le=100,
        description="Linux PSI memory 'some avg10' that also unloads workers.",
    )
    full_avg10_critical: float = Field(
        default=5, gt=0, le=100,
        description="Linux PSI memory 'full avg10' (every task stalled) that unloads workers.",
    )
    page_outs_per_s: float = Field(
        default=256, gt=0,
        description="Pages/s leaving RAM for disk (Linux pswpout; macOS vm_stat Pageouts + "
        "Swapouts) that unloads workers: the OS is already paging.",
    )
    darwin_level: Literal["warn", "critical"] = Field(
        default="warn",
        description="Lowest macOS kern.memorystatus_vm_pressure_level that stops admission "
        "(warn = 2, critical = 4); the kernel's critical level always unloads.",
    )
    poll_s: float = Field(default=1, gt=0, le=60, description="Seconds between readings.")
    clear_after_s: float = Field(
        default=10, ge=0, le=3600,
        description="Readings must stay under every line this long before admission reopens.",
    )

    @model_validator(mode="after")
    def _warn_not_above_critical(self) -> Pressure:
        if self.some_avg10_warn > self.some_avg10_critical:
            raise ValueError(
                f"pressure.someAvg10Warn ({self.some_avg10_warn:g}) is above "
                f"pressure.someAvg10Critical ({self.some_avg10_critical:g}): lower the warn "
                "line or raise the critical one"
            )
        return self


class Policy(_Strict):
    schema_version: Literal[1] = Field(description="Policy file format version.")
    host: Name
    total_ram_gb: float = Field(gt=0, description="Declared physical RAM, GiB.")
    modes: Modes
    os_floor_gb: float = Field(ge=0, description="GiB that must always stay free for the OS.")
    transient_reserve: float = Field(
        default=0.05, ge=0, le=0.5,
        description="Measured high-water transient allocations, as a fraction of the mode budget.",
    )
    trip_offset: float = Field(
        default=0.05, gt=0, le=0.2, description="trip = min(u + tripOffset, 0.99) × total RAM."
    )
    u_margin: float = Field(
        default=0.02, gt=0, le=0.2, description="Margin kept on both sides of the u band."
    )
    block_tokens: int = Field(default=16, ge=1, le=4096, description="Tokens per KV block.")
    min_context: int = Field(
        default=2048, ge=16,
        description="Smallest context a model may be clamped to before refusal.",
    )
    wire: WireChoice = Field(
        default="weights",
        description="What a worker wires: its admitted footprint, only the weights, or nothing.",
    )
    listen: Listen = Listen()
    ollama_api: bool = Field(
        default=True, description="Serve Ollama's API (/api/chat, /api/generate, /api/tags, "
        "...) on the proxy's port beside the OpenAI and Anthropic ones; false: those routes "
        "are 404.")
    cluster: Cluster = Cluster()
    pressure: Pressure = Pressure()
    disk_cache: DiskCache | None = Field(
        default=None, description="The host's disk tier for KV blocks (off when absent)."
    )
    models: dict[Name, ModelEntry] = Field(default_factory=dict)
    aliases: dict[str, Name] = Field(
        default_factory=dict,
        description="Model names clients send (glob patterns such as 'claude-*') and the "
        "model of this policy that serves them.",
    )
    default_model: Name | None = Field(
        default=None,
        description="The model that serves the names coding clients send of their own "
        "(claude-*, gpt-*, o1-*, ...) when no alias matches; default: the only model, if "
        "the policy has one.",
    )

    @model_validator(mode="after")
    def _aliases_name_models(self) -> Policy:
        if not self.models:
            return self
        for pattern, target in self.aliases.items():
            if target not in self.models:
                raise ValueError(
                    f"aliases.{pattern}: {target!r} is not a model of this policy (models: "
                    f"{', '.join(sorted(self.models))}): name one of them")
        if self.default_model is not None and self.default_model not in self.models:
            raise ValueError(
                f"defaultModel: {self.default_model!r} is not a model of this policy "
                f"(models: {', '.join(sorted(self.models))}): name one of them")
        return self

    @model_validator(mode="after")
    def _budgets_leave_os_floor(self) -> Policy:
        for mode in ("standalone", "clustered"):
            budget = getattr(self.modes, mode).max_local_llm_gb
            left = self.total_ram_gb - budget
            if left < self.os_floor_gb:
                raise ValueError(
                    f"modes.{mode}.maxLocalLlmGb: host {self.host}: {mode} budget {budget:g} GiB "
                    f"leaves {left:g} GiB of {self.total_ram_gb:g} GiB, below the OS floor of "
                    f"{self.os_floor_gb:g} GiB: lower the budget or the floor"
                )
        return self

    def disk_cache_for(self, entry: ModelEntry | None) -> DiskCache | None:
        """The model's own disk tier, else the host's."""
        return (entry.disk_cache if entry is not None and entry.disk_cache else None) or \
            self.disk_cache

    def budget_bytes(self, mode: Mode) -> int:
        return gib_to_bytes(getattr(self.modes, mode).max_local_llm_gb)


def parse_policy(data: Mapping[str, Any], source: str = "policy") -> Policy:
    """Validate shape with the committed JSON Schema, then the cross-field invariants."""
    shape = schema_errors(committed_schema(), data, source)
    if shape:
        raise PolicyError(shape)
    try:
        return Policy.model_validate(data)
    except ValidationError as err:
        raise PolicyError(validation_message(err, source)) from None


def load_policy(path: str | Path) -> Policy:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise PolicyError(f"{p}: cannot read policy file: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise PolicyError(f"{p}: not UTF-8 text (bad byte at offset {err.start}); save the "
                          "policy as UTF-8 JSON") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PolicyError(f"{p}: not valid JSON: {err.msg} at line {err.lineno}") from None
    except (ValueError, RecursionError) as err:  # a number past Python's digit limit; depth
        why = "nested too deeply" if isinstance(err, RecursionError) else "a number is too long"
        raise PolicyError(f"{p}: not valid JSON: {why}; fix the file") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{p}: the policy must be a JSON object")
    return parse_policy(data, str(p))


def policy_json_schema() -> dict[str, Any]:
    """The schema as generated from the models (what the committed file must equal)."""
    schema = Policy.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "plimsoll-policy-v1"
    return schema


def committed_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())
