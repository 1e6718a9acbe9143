"""The one table of request fields real clients send that the worker accepts and ignores.

Request models are strict (``extra="forbid"``): a field nobody listed is refused with a 400
that names it (``Unknown field 'x': remove it``). That stays the rule for a *truly unknown*
field, on purpose: an unknown field may change what the client expects back (a sampling
parameter, a format, a server tool), and answering as if it were absent would be a silent
wrong answer — the client's author and the user learn nothing. A clear refusal names the
field; when a real client turns out to send it, it is added here with the reason it is
safe, and the end-to-end test of the pinned clients (``python/tests/clients``) catches the
next one before a user does.

Each entry below is a field whose only effect, at Anthropic or OpenAI, is something this
worker either does anyway (prefix caching), has no notion of (tiers, stored completions,
user tracking) or is free to skip (hints). A tolerated field is dropped before validation
(whatever its value, as the real API would accept it) and logged once per process, with
the reason, so an operator can see what their clients send.

Scopes name the object a field sits on: ``anthropic.request`` is the body of
``/v1/messages`` (and ``count_tokens``), ``anthropic.tool`` one entry of ``tools``,
``openai.responses`` the body of ``/v1/responses``, ``ollama.request`` the body of
``/api/chat`` and ``/api/generate``, and so on. One scope holds values, not
field names: ``openai.responses.tool_type`` lists the *types* of Responses tools that are
left out of the prompt (hosted tools nothing here runs) instead of refused
(:func:`left_out`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("plimsoll.protocol")

_CACHE = ("prompt caching is automatic here (the prefix cache reuses any shared prefix); "
          "a cache breakpoint changes nothing")
_ECHO = "echoed back from an earlier response by clients; it carries nothing to render"
_TRACKING = "user or session tracking for the provider's own monitoring; nothing is tracked here"
_STRICT = ("with tool_choice auto the model's calls are parsed from its output, not constrained; "
           "a forced tool_choice constrains every call to its tool's schema, strict or not")

TOLERATED: dict[str, dict[str, str]] = {
    "anthropic.request": {
        "cache_control": _CACHE,
        "metadata": _TRACKING,
        "service_tier": "there is one service tier here",
        "context_management": "server-side context editing (clearing old thinking or tool "
                              "results) is an Anthropic beta applied before the model; here "
                              "the whole conversation is rendered (past thinking is dropped "
                              "anyway) and one over the context is a 400 with the figures",
        "container": "a code-execution container id; no server tools run here, and a request "
                     "that names a server tool is still refused",
        "inference_geo": "where Anthropic runs the request; it runs on this host",
    },
    "anthropic.system": {"cache_control": _CACHE, "citations": _ECHO},
    "anthropic.text": {"cache_control": _CACHE, "citations": _ECHO},
    "anthropic.tool_use": {"cache_control": _CACHE, "caller": _ECHO, "toolset_name": _ECHO},
    "anthropic.tool_result": {"cache_control": _CACHE, "toolset_name": _ECHO},
    "anthropic.tool": {
        "cache_control": _CACHE,
        "defer_loading": "tool-search beta (load a tool's definition only when searched "
                         "for); here every tool's definition is in the prompt from the start",
        "strict": _STRICT,
        "eager_input_streaming": "each call's input is sent as one delta",
        "input_examples": "advanced-tool-use examples for Anthropic's own prompt; the chat "
                          "template renders the schema",
        "allowed_callers": "programmatic tool calling (server code execution) is not offered; "
                           "the model calls client tools directly",
    },
    "anthropic.tool_choice": {
        "disable_parallel_tool_use": "several calls in one answer are parsed either way",
    },
    "anthropic.output_config": {"effort": "a hint on how hard to think; the model's chat "
                                          "template decides"},
    "anthropic.thinking": {"display": "how Anthropic shows summarised thinking; reasoning "
                                      "text is returned as the model wrote it",
                           "budget_tokens": "reasoning counts against max_tokens here; "
                                            "there is no separate thinking budget"},
    "openai.chat": {
        "user": _TRACKING,
        "safety_identifier": _TRACKING,
        "metadata": "stored-completion tags; completions are not stored here",
        "store": "completions are not stored here",
        "service_tier": "there is one service tier here",
        "parallel_tool_calls": "several calls in one answer are parsed either way",
        "prediction": "predicted outputs only speed up a provider's decoding; the answer is "
                      "the same without them",
        "prompt_cache_key": _CACHE,
        "prompt_cache_retention": _CACHE,
        "reasoning_effort": "a hint on how hard to think; the model's chat template decides "
                            "(reasoning text is returned as reasoning_content)",
        "verbosity": "a hint on answer length; max_tokens is the bound",
    },
    "openai.completion": {"user": _TRACKING, "metadata": "completions are not stored here",
                          "store": "completions are not stored here"},
    "openai.message": {"refusal": _ECHO, "annotations": _ECHO, "audio": _ECHO},
    "openai.stream_options": {"include_obfuscation": "no padding is added to stream chunks"},
    "openai.function": {"strict": _STRICT},
    "openai.responses": {
        "include": "asks for extra output parts (encrypted reasoning, logprobs, search "
                   "sources); this worker produces none of them, so there is nothing to add",
        "prompt_cache_key": _CACHE,
        "prompt_cache_retention": _CACHE,
        "reasoning": "effort and summary hints for reasoning models; the chat template "
                     "decides whether the model thinks, and no reasoning summary is produced",
        "service_tier": "there is one service tier here",
        "user": _TRACKING,
        "safety_identifier": _TRACKING,
        "client_metadata": "a client's own tags for the request; nothing here reads them",
        "max_tool_calls": "a cap on hosted tool calls; the model's calls are returned, none "
                          "run here",
        "truncation": "the context is never truncated here: an over-long prompt is a 400 with "
                      "the figures (as 'disabled', the API default)",
        "stream_options": "only include_obfuscation, padding this worker never adds",
        "top_logprobs": "log probabilities are not returned (0 is what the SDK sends)",
    },
    "openai.responses.text": {"verbosity": "a hint on answer length; max_output_tokens is "
                                           "the bound"},
    "openai.responses.message": {"phase": "Codex's tag on replayed assistant text; the text "
                                          "is rendered either way"},
    "openai.responses.content": {"annotations": _ECHO, "logprobs": _ECHO},
    "openai.responses.tool_type": {
        "web_search": "a hosted tool the API runs itself; nothing here runs it, so the model "
                      "is not offered it",
        "web_search_preview": "a hosted tool (as web_search)",
        "file_search": "a hosted tool over the API's vector stores, which do not exist here",
        "code_interpreter": "a hosted sandbox; nothing here runs it",
        "image_generation": "a hosted image model; nothing here runs it",
        "namespace": "a group of tools whose calls carry a namespace this worker's tool-call "
                     "parser does not produce; the group is left out of the prompt (Codex "
                     "sends its sub-agent tools so)",
    },
    "ollama.request": {
        "keep_alive": "how long Ollama keeps the model loaded after the request; here the "
                      "policy's idleTtlS (or --idle-ttl) decides when an idle worker is unloaded",
        "truncate": "the prompt is never truncated here: an over-long one is a 400 with the "
                    "figures",
        "shift": "the output reservation is fixed at admission: an answer that reaches it "
                 "ends with done_reason \"length\", never with a shifted context",
    },
    "ollama.show": {"options": "a Modelfile parameter override for the shown model; what is "
                               "shown is the model as the policy serves it"},
    "ollama.options": {
        **dict.fromkeys(
            ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
             "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread"),
            "a llama.cpp load-time setting; the worker's placement, batch and memory come "
            "from admission"),
        "num_keep": "tokens kept when the context shifts; the context never shifts here",
        "repeat_last_n": "the window of repeat_penalty, which is accepted only at 1 (off)",
        "penalize_newline": "a refinement of repeat_penalty, which is accepted only at 1 (off)",
        "mirostat_tau": "a parameter of mirostat, which is accepted only at 0 (off)",
        "mirostat_eta": "a parameter of mirostat, which is accepted only at 0 (off)",
    },
}
"""scope → field (or, for ``openai.responses.tool_type``, tool type) → why it is safe."""

_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()


def _log_once(scope: str, key: str, what: str) -> None:
    with _lock:
        first = (scope, key) not in _logged
        _logged.add((scope, key))
    if first:
        log.info("accepted and ignored %s %s %r (logged once): %s", scope, what, key,
                 TOLERATED[scope][key])


def drop_tolerated(scope: str | None, data: Any) -> Any:
    """``data`` without the fields :data:`TOLERATED` lists for ``scope`` (each new one logged
    once per process with its reason); anything else is returned unchanged."""
    table = TOLERATED.get(scope or "")
    if not table or not isinstance(data, dict) or not any(k in table for k in data):
        return data
    for key in data:
        if key in table:
            _log_once(scope, key, "field")
    return {k: v for k, v in data.items() if k not in table}


def left_out(scope: str, kind: Any) -> bool:
    """True when the value ``kind`` (a tool's type) is one :data:`TOLERATED` lists for
    ``scope``: the caller leaves that object out (logged once, with the reason)."""
    if not isinstance(kind, str) or kind not in TOLERATED.get(scope, {}):
        return False
    _log_once(scope, kind, "value")
    return True


def names(scope: str) -> list[str]:
    """The names listed for ``scope``, sorted (for error messages)."""
    return sorted(TOLERATED.get(scope, {}))
