"""The proxy's refusals: what the HTTP edge turns into an OpenAI- or Anthropic-shaped error."""

from __future__ import annotations

from typing import Any


class ProxyError(Exception):
    """A refusal the HTTP edge turns into an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, code: str, *, retry_after: int | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.retry_after, self.extra = retry_after, extra or {}
