"""Generated token ids to OpenAI output, one token at a time.

A :class:`TextAssembler` is the one place that decides when a request's output is
complete from its text: EOS ids, stop strings, ``max_tokens``. The scheduler feeds it
the sampled ids and cancels the sequence once :attr:`TextAssembler.done` is true. It
yields deltas for streaming, and the streamed text deltas always concatenate to the
final ``text`` (nothing is emitted that is later taken back).

Why text is held back: a stop string or a tool-call marker can arrive split over
several tokens (``"EN"`` + ``"D"``), so the tail of the text that could still become
one is kept until the next token decides it. With tools, whitespace next to a tool call
is held too and dropped (Qwen-style models put newlines between calls), so a response
that is only tool calls has ``content: null``.

Tool calls are found in the text between the tokenizer's ``tool_call_start`` and
``tool_call_end`` markers and parsed by its ``tool_parser`` (mlx-lm infers both from
the chat template). A call that does not parse is kept as plain text, markers and all,
so nothing the model wrote is lost silently.

With ``reasoning`` markers (:mod:`.reasoning`), text inside a reasoning block comes out as
:class:`ReasoningDelta` and lands in :attr:`Assembled.reasoning`, not in the answer.
"""

from __future__ import annotations

import contextlib
import json
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

from .reasoning import Markers, ReasoningSplit
from .requests import ChatCompletionRequest, Request

FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One complete tool call: ``call`` is ``{id, type: "function", function: {name,
    arguments}}`` with ``arguments`` a JSON string; ``index`` its place in ``tool_calls``."""

    index: int
    call: dict[str, Any]


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning text (between the model's think markers): ``reasoning_content`` /
    a ``thinking`` block, never the answer."""

    text: str


Delta = TextDelta | ToolCallDelta | ReasoningDelta


@dataclass(frozen=True)
class Assembled:
    """The whole output of a finished request."""

    text: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    completion_tokens: int = 0
    reasoning: str = ""

    @property
    def content(self) -> str | None:
        """The message content: None when the answer is only tool calls."""
        return None if self.tool_calls and not self.text else self.text


def _partial_suffix(text: str, needles: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a needle."""
    best = 0
    for needle in needles:
        if len(needle) < 2 or needle[0] not in text[-(len(needle) - 1):]:
            continue  # the common case, per token: no start of the needle in the tail
        for k in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:k]):
                best = k
                break
    return best


def fresh_detokenizer(tokenizer: Any) -> Any:
    """A streaming detokenizer of its own, primed so a leading space survives.

    mlx-lm's detokenizers drop a space at the very start of their text (right for a
    sentencepiece prompt, wrong for output: a completion of "The capital is" is
    " Paris"). Priming with one newline token puts the output after some text, as it
    is after the prompt, and the newline's own segment is discarded. Tokenizers whose
    newline is not one clean token are left unprimed (mlx-lm's behaviour).
    """
    detok = tokenizer.detokenizer  # mlx-lm hands out a reset copy per access
    detok.reset()
    newline = _newline(tokenizer)
    if len(newline) == 1:
        detok.add_token(newline[0])
        if detok.last_segment != "\n":
            detok.reset()
    return detok


_NEWLINES: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def _newline(tokenizer: Any) -> list[int]:
    """The newline's ids, encoded once per tokenizer (an encode costs ~1 ms a request)."""
    try:
        return _NEWLINES[tokenizer]
    except (KeyError, TypeError):
        ids = tokenizer.encode("\n", add_special_tokens=False)
    with contextlib.suppress(TypeError):  # not weak-referenceable: encoded each time
        _NEWLINES[tokenizer] = ids
    return ids


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class TextAssembler:
    """Incremental detokenizing, stop strings, EOS, ``max_tokens`` and tool-call parsing.

    One instance per request (it owns its own streaming detokenizer). ``tools`` (the
    request's tools as dicts) turns on tool-call parsing when the tokenizer has tool
    calling; ``max_tokens`` None leaves the length limit to the caller's :meth:`close`.
    """

    def __init__(self, tokenizer: Any, *, stop: list[str] | tuple[str, ...] = (),
                 max_tokens: int | None = None, tools: list[dict[str, Any]] | None = None,
                 reasoning: Markers | None = None, ignore_eos: bool = False):
        self._split = ReasoningSplit(reasoning) if reasoning is not None else None
        self._reasoning: list[str] = []
        self._detok = fresh_detokenizer(tokenizer)
        self._eos = set(tokenizer.eos_token_ids or ())
        self._ignore_eos = ignore_eos  # an EOS token is counted, not shown, and goes on
        self._stop = [s for s in stop if s]
        self.max_tokens = max_tokens
        self._tools = tools
        self._tooling = bool(tools) and bool(getattr(tokenizer, "has_tool_calling", False))
        self._start = tokenizer.tool_call_start if self._tooling else ""
        self._end = tokenizer.tool_call_end if self._tooling else ""
        self._parser = tokenizer.tool_parser if self._tooling else None
        self._held_for = self._stop + ([self._start] if self._tooling else [])
        self._pending = ""  # decoded text not yet emitted
        self._tool_buf = ""  # text after a tool_call_start marker, until its end marker
        self._in_tool = False
        self._after_tool = False  # strip whitespace that follows a tool call
        self._ws_before = ""  # whitespace dropped before the current tool call
        self._stopped = False  # a stop string was found
        self._parts: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._count = 0
        self._finish: FinishReason | None = None

    @classmethod
    def for_request(cls, tokenizer: Any, req: Request, max_tokens: int | None,
                    reasoning: Markers | None = None) -> TextAssembler:
        """An assembler with the request's stop strings and (for chat) active tools and
        reasoning markers (completions return the raw text)."""
        chat = isinstance(req, ChatCompletionRequest)
        return cls(tokenizer, stop=req.stop, max_tokens=max_tokens,
                   tools=req.active_tools if chat else None,
                   reasoning=reasoning if chat else None,
                   ignore_eos=getattr(req, "ignore_eos", False))

    @property
    def done(self) -> bool:
        """True once the output is complete; later tokens are ignored."""
        return self._finish is not None

    @property
    def completion_tokens(self) -> int:
        return self._count

    def feed(self, token: int) -> list[Delta]:
        """Take one generated token; return the deltas it completes (often none)."""
        if self.done:
            return []
        self._count += 1
        if token in self._eos:
            if not self._ignore_eos:
                return self.close("stop")
            out = []
        else:
            self._detok.add_token(token)
            out = self._absorb(self._detok.last_segment)
        if self._stopped:
            return out + self.close("stop")
        if self.max_tokens is not None and self._count >= self.max_tokens:
            return out + self.close("length")
        return out

    def close(self, reason: Literal["stop", "length"] = "length") -> list[Delta]:
        """End the output (the caller's limit, or a sequence the engine ended): flush all
        held text. Idempotent. ``"stop"`` becomes ``"tool_calls"`` if calls were made."""
        if self.done:
            return []
        out: list[Delta] = []
        if not self._stopped:
            self._detok.finalize()
            out += self._absorb(self._detok.last_segment, final=True)
        if self._in_tool:  # never closed: a stop string in it ends the text there, else
            markup = self._start + self._tool_buf  # parse what there is (or keep it as text)
            stops = [i for s in self._stop if (i := markup.find(s)) >= 0]
            if stops:
                out += self._text(self._ws_before + markup[:min(stops)])
                self._stopped = True
            else:
                out += self._tool_call(self._tool_buf, closed=False)
            self._in_tool, self._tool_buf = False, ""
        if not self._stopped:
            rest = self._pending.rstrip() if self._calls else self._pending
            out += self._text(rest)
        if self._split is not None:
            out += self._pieces(self._split.flush())
        self._pending = ""
        self._finish = "tool_calls" if reason == "stop" and self._calls else reason
        return out

    def result(self) -> Assembled:
        """The whole output; call once :attr:`done` (after :meth:`close` at the latest)."""
        if self._finish is None:
            raise RuntimeError("result() before the output is done; call close() first")
        return Assembled("".join(self._parts), list(self._calls), self._finish, self._count,
                         "".join(self._reasoning))

    # --- internals ----------------------------------------------------------------------

    def _text(self, text: str) -> list[Delta]:
        if self._after_tool:
            text = text.lstrip()
        if not text:
            return []
        self._after_tool = False
        if self._split is not None:
            return self._pieces(self._split.feed(text))
        self._parts.append(text)
        return [TextDelta(text)]

    def _pieces(self, pieces: list[tuple[bool, str]]) -> list[Delta]:
        out: list[Delta] = []
        for reasoning, text in pieces:
            (self._reasoning if reasoning else self._parts).append(text)
            out.append(ReasoningDelta(text) if reasoning else TextDelta(text))
        return out

    def _first_stop(self) -> int:
        hits = [i for s in self._stop if (i := self._pending.find(s)) >= 0]
        return min(hits, default=-1)

    def _absorb(self, segment: str, final: bool = False) -> list[Delta]:
        out: list[Delta] = []
        scan = 0  # where the end marker may start: a long call is not rescanned per token
        if self._in_tool:
            scan = max(0, len(self._tool_buf) - len(self._end) + 1)
            self._tool_buf += segment
        else:
            self._pending += segment
        while True:
            if self._in_tool:
                end = self._tool_buf.find(self._end, scan)
                if end < 0:
                    return out
                scan = 0
                out += self._tool_call(self._tool_buf[:end], closed=True)
                self._pending = self._tool_buf[end + len(self._end):]
                self._tool_buf, self._in_tool = "", False
                if self._stopped:  # the markup was text after all, and held a stop string
                    self._pending = ""
                    return out
                continue
            stop = self._first_stop()
            start = self._pending.find(self._start) if self._tooling else -1
            if stop >= 0 and (start < 0 or stop < start):
                text = self._pending[:stop]
                out += self._text(text.rstrip() if self._calls else text)
                self._pending, self._stopped = "", True
                return out
            if start < 0:
                break
            before = self._pending[:start]
            out += self._text(before.rstrip())
            self._ws_before = before[len(before.rstrip()):]  # given back if the call fails
            self._tool_buf = self._pending[start + len(self._start):]
            self._pending, self._in_tool = "", True
        if final:
            return out
        hold = _partial_suffix(self._pending, self._held_for)
        if self._tooling:
            hold = max(hold, len(self._pending) - len(self._pending.rstrip()))
        cut = len(self._pending) - hold
        out += self._text(self._pending[:cut])
        self._pending = self._pending[cut:]
        return out

    def _tool_call(self, body: str, closed: bool) -> list[Delta]:
        try:
            parsed = self._parser(body, self._tools)
        except Exception:  # the parser is the model family's; any failure means "not a call"
            parsed = None
        calls = parsed if isinstance(parsed, list) else [parsed]
        if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                and isinstance(c.get("arguments", {}), dict | str)
                                for c in calls):
            self._after_tool = False
            text = self._ws_before + self._start + body + (self._end if closed else "")
            stops = [i for s in self._stop if (i := text.find(s)) >= 0]
            if stops:  # markup that is not a call is text: a stop string in it ends the output
                self._stopped = True
                return self._text(text[:min(stops)])
            return self._text(text)
        out: list[Delta] = []
        for c in calls:
            args = c.get("arguments", {})
            call = {"id": c.get("id") or new_tool_call_id(), "type": "function",
                    "function": {"name": c["name"], "arguments": args if isinstance(args, str)
                                 else json.dumps(args, ensure_ascii=False)}}
            out.append(ToolCallDelta(len(self._calls), call))
            self._calls.append(call)
        self._after_tool = True
        return out
