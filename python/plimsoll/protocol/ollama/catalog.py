"""Ollama's model listings, built from what the proxy knows of each model (pure).

``/api/tags`` lists every model of the policy, ``/api/ps`` the loaded ones, ``/api/show``
one in detail, ``/api/version`` the Ollama API version these routes follow. A model is
named ``name:latest``, as Ollama names a model without a tag (the name resolves either
way). ``model_info`` carries the figures clients size their requests by, under Ollama's
GGUF-style keys: ``<family>.context_length`` is the context the model is *served* with
(what admission granted, so a client that sends it as ``num_ctx`` fits), beside the
architecture's own figures where ``config.json`` states them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

OLLAMA_VERSION = "0.12.0"
"""The Ollama release whose API these routes follow. Clients compare it with the minimum
they need (for tools, ``format`` schemas, ``think``), so it names a release that has them."""
TAG = ":latest"


@dataclass(frozen=True)
class ModelView:
    """One model as the listings show it; figures the model directory does not state are
    None (and left out)."""

    name: str
    path: str
    modified_at: str
    size: int = 0
    family: str = ""
    parameter_count: int | None = None
    quantization: str = ""
    context: int | None = None
    template: str = ""
    capabilities: tuple[str, ...] = ("completion",)
    architecture: dict[str, int] = field(default_factory=dict)

    @property
    def tagged(self) -> str:
        return self.name + TAG

    @property
    def digest(self) -> str:
        """A stable id of the served model (its name and directory), in Ollama's form."""
        return hashlib.sha256(f"{self.name}\0{self.path}".encode()).hexdigest()


def parameter_size(count: int | None) -> str:
    """``7.6B``, ``494.0M``, ``2.1K`` (Ollama's ``parameter_size``); "" when unknown."""
    if not count:
        return ""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def details(m: ModelView) -> dict[str, Any]:
    return {"parent_model": "", "format": "safetensors", "family": m.family,
            "families": [m.family] if m.family else None,
            "parameter_size": parameter_size(m.parameter_count),
            "quantization_level": m.quantization}


def tag_entry(m: ModelView) -> dict[str, Any]:
    """One model of ``/api/tags``."""
    return {"name": m.tagged, "model": m.tagged, "modified_at": m.modified_at,
            "size": m.size, "digest": m.digest, "details": details(m)}


def tags(models: list[ModelView]) -> dict[str, Any]:
    return {"models": [tag_entry(m) for m in models]}


def running_entry(m: ModelView, size: int, expires_at: str) -> dict[str, Any]:
    """One loaded model of ``/api/ps``: ``size`` its admitted footprint (all of it in the
    accelerator's memory, which is the host's on unified memory), ``expires_at`` when it is
    unloaded if it stays idle."""
    return {"name": m.tagged, "model": m.tagged, "size": size, "digest": m.digest,
            "details": details(m), "expires_at": expires_at, "size_vram": size,
            "context_length": m.context}


def model_info(m: ModelView) -> dict[str, Any]:
    """GGUF-style keys: ``general.*`` and ``<family>.<figure>``."""
    arch = m.family or "unknown"
    info: dict[str, Any] = {"general.architecture": arch, "general.basename": m.name}
    if m.parameter_count:
        info["general.parameter_count"] = m.parameter_count
    if m.context is not None:
        info[f"{arch}.context_length"] = m.context
    info.update({f"{arch}.{key}": value for key, value in m.architecture.items()})
    return info


def show(m: ModelView) -> dict[str, Any]:
    """``/api/show``: the Modelfile Ollama would print, its parameters, the chat template,
    the details, ``model_info`` and the capabilities."""
    parameters = f"num_ctx {m.context}" if m.context is not None else ""
    modelfile = (f"# Served by plimsoll from the policy; not an Ollama Modelfile.\n"
                 f"FROM {m.path}\n" + (f"PARAMETER {parameters}\n" if parameters else ""))
    return {"modelfile": modelfile, "parameters": parameters, "template": m.template,
            "details": details(m), "model_info": model_info(m),
            "capabilities": list(m.capabilities), "modified_at": m.modified_at}


def version() -> dict[str, Any]:
    return {"version": OLLAMA_VERSION}
