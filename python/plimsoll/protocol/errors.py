"""OpenAI-shaped errors, the request-body limit and the context-overflow message.

Every refusal the protocol layer makes is a :class:`ProtocolError`: a status, a message
that says what to change, and the request field at fault. It is returned (``parse_request``)
or raised (``render_chat``, where a chat template fails deep inside a call) — never a bare
exception the HTTP app would turn into a 500.
"""

from __future__ import annotations

from typing import Any

MAX_BODY_BYTES = 8 * 1024 * 1024
"""Request bodies above this are refused with 413 before they are parsed (8 MiB: a
~2M-token conversation; a bigger one cannot fit any context we admit anyway)."""

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class ProtocolError(Exception):
    """A request the worker refuses, in the OpenAI error shape.

    ``type`` defaults from the status (400/413 ``invalid_request_error``, 404
    ``not_found_error``, 429 ``rate_limit_error``, 5xx ``server_error``); ``code`` is a
    short machine-readable reason such as ``"pool_exhausted"``.
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.status, self.message, self.param, self.code, self.type)

    def __repr__(self) -> str:
        return (f"ProtocolError(status={self.status}, param={self.param!r}, "
                f"code={self.code!r}, message={self.message!r})")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    """The OpenAI error object for any status (used for errors the app makes itself)."""
    return {"error": {"message": message, "type": type or _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def check_body_size(size: int | str | None, limit: int = MAX_BODY_BYTES) -> ProtocolError | None:
    """Refuse a body by its byte count or its ``Content-Length`` header value, else None.

    ``None`` (no header: a chunked body) passes; the app must then count the bytes it
    reads and call this again with the running total.
    """
    if size is None:
        return None
    if isinstance(size, str):
        if not size.strip().isdigit():
            return ProtocolError(400, f"Content-Length {size!r} is not a byte count; send the "
                                 "body's length in bytes", code="invalid_content_length")
        size = int(size)
    if size > limit:
        return ProtocolError(413, f"The request body is {size} bytes; the limit is {limit} bytes "
                             f"({limit // (1024 * 1024)} MiB). Send a shorter conversation.",
                             code="body_too_large")
    return None


def context_overflow_message(native_max: int | None, configured_context: int,
                             prompt_tokens: int, output_reservation: int) -> str:
    """Why ``prompt + output reservation`` does not fit, with the five context figures.

    The figures are kept apart (docs/DESIGN.md, "Admission"): the model-native maximum, the worker's
    configured total context, the actual prompt tokens, the output reservation
    (``max_tokens``, or the worker's default) and the actual total (prompt + reservation).
    """
    total = prompt_tokens + output_reservation
    native = f"{native_max} tokens" if native_max else "unknown"
    figures = (f"model-native maximum context: {native}; configured total context: "
               f"{configured_context} tokens; prompt: {prompt_tokens} tokens; output "
               f"reservation (max_tokens): {output_reservation} tokens; total: {total} tokens "
               f"= {prompt_tokens} + {output_reservation}")
    if prompt_tokens >= configured_context:
        change = (f"The prompt alone is over the configured context: shorten it by at least "
                  f"{prompt_tokens - configured_context + 1} tokens (leaving room for output), "
                  f"or restart the worker with a larger --context.")
    else:
        change = (f"Lower max_tokens to at most {configured_context - prompt_tokens}, shorten the "
                  f"prompt by {total - configured_context} tokens, or restart the worker with a "
                  f"larger --context.")
    return f"This request needs {total} tokens of context but the worker allows " \
           f"{configured_context} ({figures}). {change}"


def context_overflow(native_max: int | None, configured_context: int, prompt_tokens: int,
                     output_reservation: int, prompt_param: str = "messages"
                     ) -> ProtocolError | None:
    """The 400 for ``prompt_tokens + output_reservation > configured_context``, else None.

    ``prompt_param`` names the prompt field: ``"messages"`` (chat) or ``"prompt"``.
    """
    if prompt_tokens + output_reservation <= configured_context:
        return None
    param = prompt_param if prompt_tokens >= configured_context else "max_tokens"
    return ProtocolError(400, context_overflow_message(native_max, configured_context,
                                                       prompt_tokens, output_reservation),
                         param=param, code="context_length_exceeded")


def check_model(requested: str | None, served: str) -> ProtocolError | None:
    """The 404 for a request naming another model than the one served (None passes)."""
    if requested is None or requested == served:
        return None
    return ProtocolError(404, f"The model {requested!r} is not served here; this worker serves "
                         f"{served!r}. Send model {served!r} or omit it.", param="model",
                         code="model_not_found")
