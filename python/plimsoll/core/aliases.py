"""Which served model answers a request's ``model`` name (pure).

Coding clients send model names of their own: Claude Code ``claude-sonnet-…`` and, for
background work, ``claude-haiku-…``; OpenAI clients ``gpt-…``, ``o3…``, ``codex-…``. A name
the policy serves is that model; else the policy's ``aliases`` (glob patterns, first match
in the file's order); else, for a name of one of those client families, the policy's
``defaultModel`` (or its only model). Any other name is unknown: a 404 that lists the
models.

Ollama's clients name a model ``name:tag`` and ``latest`` is the tag a bare name means
(``/api/tags`` lists ``demo-tiny:latest``); policy names hold no ``:``, so ``x:latest``
is ``x`` wherever a name is resolved.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from .policy import Policy

#: Names coding clients send of their own accord, served by the default model.
CLIENT_FAMILIES = ("claude-*", "gpt-*", "o[0-9]*", "codex-*", "chatgpt-*")
#: The tag an Ollama name without one means.
DEFAULT_TAG = ":latest"


def untagged(name: str) -> str:
    """``name`` without Ollama's default tag (``demo-tiny:latest`` is ``demo-tiny``)."""
    return name.removesuffix(DEFAULT_TAG)


def default_model(policy: Policy) -> str | None:
    """``defaultModel``, else the only model of the policy, else None."""
    if policy.default_model is not None:
        return policy.default_model
    return next(iter(policy.models)) if len(policy.models) == 1 else None


def resolve(name: str, policy: Policy) -> str | None:
    """The model of ``policy`` that serves ``name``, or None."""
    name = untagged(name)
    if name in policy.models:
        return name
    for pattern, target in policy.aliases.items():
        if fnmatchcase(name, pattern):
            return target
    if any(fnmatchcase(name, p) for p in CLIENT_FAMILIES):
        return default_model(policy)
    return None
