"""Reasoning text (``<think>…</think>``) split from the answer, one text segment at a time.

The markers are the tokenizer's own, as mlx-lm infers them (``TokenizerWrapper.think_start``
/ ``think_end``: ``<think>``, ``<longcat_think>``, ``<|think:start|>``, ``<|channel>thought``
… ``<channel|>``, the xtml pair), else ``<think>`` / ``</think>`` as text. A prompt that ends
inside an open reasoning block (templates that put ``<think>`` in the generation prompt, as
Qwen3's thinking models do) starts the output in reasoning. A marker split over several
tokens is held until the next segment decides it, so the pieces always concatenate to the
text with the markers removed. OpenAI routes return the reasoning as
``reasoning_content``, Anthropic routes as ``thinking`` blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_MARKERS = ("<think>", "</think>")


@dataclass(frozen=True)
class Markers:
    start: str
    end: str
    reasoning_first: bool = False  # the prompt left a reasoning block open


def markers_for(tokenizer: Any, prompt: list[int] | None = None) -> Markers:
    """The tokenizer's reasoning markers, and whether ``prompt`` leaves a block open."""
    if getattr(tokenizer, "has_thinking", False) and tokenizer.think_start and \
            tokenizer.think_end:
        open_ = False
        if prompt:
            try:
                open_ = tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)
            except (AttributeError, TypeError, ValueError):  # an older mlx-lm wrapper
                open_ = False
        return Markers(tokenizer.think_start, tokenizer.think_end, open_)
    return Markers(*DEFAULT_MARKERS)


def _partial(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    if len(marker) < 2 or marker[0] not in text[-(len(marker) - 1):]:
        return 0  # the common case, per token: no start of the marker in the tail
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplit:
    """Text segments in, ``(is_reasoning, text)`` pieces out; :meth:`flush` at the end."""

    def __init__(self, markers: Markers) -> None:
        self.markers = markers
        self.reasoning = markers.reasoning_first
        self._held = ""
        self._strip = markers.reasoning_first  # whitespace right after a marker is dropped

    def feed(self, text: str) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        buf = self._held + text
        self._held = ""
        while buf:
            marker = self.markers.end if self.reasoning else self.markers.start
            at = buf.find(marker)
            if at < 0:
                keep = _partial(buf, marker)
                self._add(out, buf[:len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                break
            self._add(out, buf[:at])
            buf = buf[at + len(marker):]
            self.reasoning = not self.reasoning
            self._strip = True
        return out

    def flush(self) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        held, self._held = self._held, ""
        self._add(out, held)
        return out

    def _add(self, out: list[tuple[bool, str]], text: str) -> None:
        if self._strip:
            text = text.lstrip()
            if not text:
                return
            self._strip = False
        if text:
            out.append((self.reasoning, text))
