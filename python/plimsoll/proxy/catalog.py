"""The policy's models as listings show them, without loading one: ``GET /v1/models/{id}``
(OpenAI's retrieve) and the figures Ollama's listings are built from.

:func:`retrieve` answers one model of ``GET /v1/models`` — the same card, so the two never
disagree — for a name the policy serves, an alias of it or ``name:latest``; an unknown id
is a 404 in OpenAI's error shape. :func:`model_view` reads what Ollama's ``/api/tags`` and
``/api/show`` print from the model directory (``config.json``, the safetensors headers and
the tokenizer's chat template; never a weight byte) and from admission (the context the
model is served with: its running worker's grant, else what admission grants now).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from plimsoll.core.aliases import resolve
from plimsoll.core.model_facts import ModelFacts, inspect_model
from plimsoll.core.safetensors_header import ModelInspectionError, load_json, weights_by_dtype

from .. import protocol
from ..protocol.ollama import catalog as ollama_catalog
from ..protocol.ollama import timestamp
from .supervisor import Supervisor

Endpoint = Callable[[Request], Awaitable[Response]]
_FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
_ARCHITECTURE = {"embedding_length": "hidden_size", "block_count": "num_layers",
                 "feed_forward_length": "intermediate_size",
                 "attention.head_count": "num_attention_heads",
                 "attention.head_count_kv": "num_key_value_heads",
                 "attention.key_length": "head_dim"}


def retrieve(listing: Endpoint) -> Endpoint:
    """``GET /v1/models/{model}`` over the ``GET /v1/models`` endpoint ``listing``: its card
    for the model the id names (an alias's card says ``id`` as asked and ``root`` the
    served model, as vLLM's do)."""

    async def endpoint(request: Request) -> Response:
        listed = await listing(request)
        if listed.status_code != 200:  # the API key
            return listed
        asked = request.path_params["model"]
        sup: Supervisor = request.app.state.supervisor
        served = resolve(asked, sup.policy)
        cards = {c["id"]: c for c in json.loads(bytes(listed.body))["data"]}
        if served not in cards:
            known = ", ".join(sorted(cards)) or "(none)"
            return JSONResponse(protocol.error_body(
                404, f"the model {asked!r} is not served here; known models: {known} (or an "
                "alias of the policy's 'aliases')", param="model", code="model_not_found"), 404)
        card = cards[served]
        return JSONResponse(card if asked == served else {**card, "id": asked, "root": served})

    return endpoint


def chat_template(model_dir: Path) -> str:
    """The tokenizer's chat template, as mlx-lm finds it ("" for none)."""
    for name in _TEMPLATE_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if name.endswith(".jinja"):
            return text
        try:
            template = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            continue
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict)
                             and t.get("name") == "default"), None)
        if isinstance(template, str):
            return template
    return ""


def capabilities(template: str) -> tuple[str, ...]:
    """What Ollama's clients gate features on: ``completion`` always, ``tools`` when the
    chat template renders tools, ``thinking`` when it opens a think block."""
    found = ["completion"]
    if "tools" in template:
        found.append("tools")
    if "<think>" in template or "enable_thinking" in template:
        found.append("thinking")
    return tuple(found)


def _bits(config: dict[str, Any]) -> int | None:
    quant = config.get("quantization")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    return bits if isinstance(bits, int) and bits > 0 else None


def _parameters(model_dir: Path, config: dict[str, Any], facts: ModelFacts) -> int | None:
    """The parameter count from the safetensors headers: float tensors by their dtype's
    width, packed quantized ones by the config's bits."""
    bits = _bits(config)
    count = 0
    for dtype, n in weights_by_dtype(model_dir, facts.num_layers, []).items():
        if dtype in _FLOAT_BYTES:
            count += n // _FLOAT_BYTES[dtype]
        elif dtype in ("U32", "I32") and bits is not None:
            count += n * 8 // bits
    return count or None


def _quantization(config: dict[str, Any], facts: ModelFacts) -> str:
    if (bits := _bits(config)) is not None:
        return f"Q{bits}"
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(facts.kv_dtype,
                                                                        facts.kv_dtype.upper())


def served_context(sup: Supervisor, name: str) -> int | None:
    """The context ``name`` is served with: its running worker's, else admission's grant
    now (None when admission refuses it); raises the ProxyError of an unreadable model."""
    w = sup.workers[name]
    dec = w.current.decision if w.current is not None else sup.admit(w, sup.figures())[1]
    return dec.context if dec.admitted else None


def model_view(name: str, path: str, context: int | None) -> ollama_catalog.ModelView:
    """Model ``name`` at ``path``, served with ``context``, as Ollama's listings show it
    (file reads: run it on a thread). A directory that cannot be read is shown with what is
    known."""
    model_dir = Path(path).expanduser()
    try:
        facts = inspect_model(model_dir)
        config = load_json((model_dir / "config.json").read_bytes(), "config.json")
        modified = datetime.fromtimestamp((model_dir / "config.json").stat().st_mtime, UTC)
        template = chat_template(model_dir)
        params = _parameters(model_dir, config, facts)
    except (OSError, ModelInspectionError):
        return ollama_catalog.ModelView(name, str(model_dir),
                                        timestamp(datetime.fromtimestamp(0, UTC)),
                                        context=context)
    arch = {key: getattr(facts, attr) for key, attr in _ARCHITECTURE.items()
            if isinstance(getattr(facts, attr), int)}
    return ollama_catalog.ModelView(
        name, str(model_dir), timestamp(modified), size=facts.weights_bytes,
        family=facts.model_type, parameter_count=params,
        quantization=_quantization(config, facts), context=context, template=template,
        capabilities=capabilities(template), architecture=arch)
