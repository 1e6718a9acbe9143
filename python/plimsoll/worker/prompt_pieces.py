"""Prompt tokenizing that does not redo the part of a conversation the worker saw before.

A chat prompt is rendered again from the whole conversation on every request, and most of
it is text this worker has tokenized already: the 16k-token system prompt seven sub-agents
share, the earlier turns of an agentic session. Tokenizing it is the API process's largest
cost per request (a 17k-token prompt: ~20-40 ms of one core), and several long prompts
arriving together queue behind each other for the cores.

A fast tokenizer (HF ``tokenizers``) splits its input at its added tokens (``<|im_start|>``,
``<|im_end|>`` …) before anything else and tokenizes each piece between them on its own
(``AddedVocabulary``: split, then normalize, pre-tokenize and run the model per piece), so a
prompt's ids are its pieces' ids, one after the other, with each added token's id between.
:class:`PieceEncoder` splits a rendered prompt at the added tokens that split it first (not
normalized, no whitespace stripping, not single-word), keeps the ids of long pieces (LRU,
at most :data:`CACHE_BYTES` of text and ids) and tokenizes only the pieces it has not seen,
all of them in one ``encode_batch`` (which releases the GIL, so other requests go on). A long
piece another request is tokenizing at that moment is waited for, not tokenized again: eight
sub-agents sent at once with one new 16k-token system prompt tokenize it once (on an H100
host the eight spent 0.24-0.38 s each in rendering and tokenizing, one alone 0.05 s:
bench/results/serving-h100-2026-12-05k-subagents-access.log).

Exact, and checked rather than assumed: at start :func:`checked` encodes sample prompts
(the model's own chat template over awkward text: whitespace and newlines at the piece
edges, unicode, added tokens side by side) both ways, and the encoder is used only if every
one gives the tokenizer's own ids; otherwise the prompt is tokenized whole as before and the
status says why (``prompt_pieces``). mlx-lm's own chat-template path tokenizes the rendered
text the same way (``encode(text, add_special_tokens=False)``).
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from collections import OrderedDict
from typing import Any

#: The cache's bound: the pieces' text and ids together. Part of the API process's own
#: memory, which the guard's runtime reserve holds (docs/DESIGN.md, the process model).
CACHE_BYTES = 32 << 20
#: Pieces shorter than this are tokenized every time: cheap, and they would churn the cache.
MIN_CACHED_CHARS = 256
_ENTRY_OVERHEAD = 200  # dict slot, OrderedDict link, array header: an over-estimate


class PieceEncoder:
    """A rendered prompt's ids, piece by piece between added tokens, long pieces cached.

    ``rust`` is the ``tokenizers.Tokenizer`` behind the fast tokenizer. Thread-safe: the
    cache is taken under a lock, tokenizing happens outside it, and a long piece is
    tokenized by one thread at a time: prompts that arrive together with the same new
    system prompt wait for the first one's ids instead of each tokenizing it."""

    def __init__(self, rust: Any) -> None:
        self._rust = rust
        splitting = {t.content: i for i, t in rust.get_added_tokens_decoder().items()
                     if not (t.normalized or t.lstrip or t.rstrip or t.single_word)}
        self._ids = splitting
        alternatives = sorted(splitting, key=len, reverse=True)  # the longest match first
        self._split = (re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
                       if alternatives else None)
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        #: long pieces a thread is tokenizing now: another prompt that needs one waits for
        #: it (then reads the cache) rather than tokenizing the same text again
        self._inflight: dict[str, threading.Event] = {}
        self.hits = self.misses = self.waited = 0

    def encode(self, text: str) -> list[int]:
        parts = self._split.split(text) if self._split is not None else [text]
        found: dict[int, array | int] = {}
        missing: list[int] = []  # this call tokenizes them
        mine: list[str] = []  # long pieces this call now tokenizes for everyone
        others: dict[int, threading.Event] = {}  # long pieces another call is tokenizing
        with self._lock:
            for i, part in enumerate(parts):
                if i % 2:  # the split's captures: an added token
                    found[i] = self._ids[part]
                elif len(part) < MIN_CACHED_CHARS:
                    if part:
                        missing.append(i)
                elif (ids := self._cache.get(part)) is not None:
                    self._cache.move_to_end(part)
                    found[i] = ids
                    self.hits += 1
                elif (event := self._inflight.get(part)) is not None:
                    others[i] = event
                else:  # (the same piece again in this prompt: the branch above, then)
                    self._inflight[part] = threading.Event()
                    mine.append(part)
                    missing.append(i)
        try:
            self._tokenize(parts, missing, found)
        finally:  # waiters are let go whatever happened; they tokenize it if it is not cached
            with self._lock:
                for part in mine:
                    self._inflight.pop(part).set()
        if others:
            for event in others.values():
                event.wait()
            with self._lock:
                for i in list(others):
                    if (ids := self._cache.get(parts[i])) is not None:
                        found[i] = ids
                        del others[i]
                        self.waited += 1
            self._tokenize(parts, list(others), found)  # not cached after all (too big)
        out: list[int] = []
        for i in range(len(parts)):
            got = found.get(i)
            if isinstance(got, int):
                out.append(got)
            elif got is not None:
                out.extend(got)
        return out

    def _tokenize(self, parts: list[str], which: list[int], found: dict) -> None:
        """``parts[i]`` for each ``i`` of ``which`` tokenized in one batch into ``found``;
        the long ones kept."""
        if not which:
            return
        encoded = self._rust.encode_batch([parts[i] for i in which], add_special_tokens=False)
        for i, enc in zip(which, encoded, strict=True):
            found[i] = ids = array("i", enc.ids)
            if len(parts[i]) >= MIN_CACHED_CHARS:
                self._keep(parts[i], ids)

    def _keep(self, piece: str, ids: array) -> None:
        size = _size(piece, ids)
        if size > CACHE_BYTES:
            return
        with self._lock:
            self.misses += 1
            if piece in self._cache:
                return
            self._cache[piece] = ids
            self._bytes += size
            while self._bytes > CACHE_BYTES:
                old, old_ids = self._cache.popitem(last=False)
                self._bytes -= _size(old, old_ids)

    def figures(self) -> dict[str, int]:
        with self._lock:
            return {"pieces": len(self._cache), "bytes": self._bytes,
                    "cap_bytes": CACHE_BYTES, "hits": self.hits, "misses": self.misses,
                    "waited": self.waited}


def _size(piece: str, ids: array) -> int:
    return sys.getsizeof(piece) + ids.itemsize * len(ids) + _ENTRY_OVERHEAD


#: Text the start-time check renders through the model's template: the edges where a
#: piece-wise tokenizing would differ if the tokenizer did not split first at added tokens.
_AWKWARD = ["", " ", "\n", "\n\n  lead and trail  \n", "tabs\tand\r\nreturns", "ünïcödé 日本語 🚀",
            "code:\n    def f(x):\n        return x  # ok\n", "a" * (MIN_CACHED_CHARS + 3),
            "  spaces   between   words  " * 20]


def samples(tokenizer: Any) -> list[str]:
    """Prompts to check on: the model's template over awkward text, and the added tokens
    side by side, at the edges and inside words."""
    out: list[str] = []
    for text in _AWKWARD:
        turns = [{"role": "system", "content": text}, {"role": "user", "content": "hi"},
                 {"role": "assistant", "content": text}, {"role": "user", "content": text}]
        for messages in ([{"role": "user", "content": text}], turns):
            try:
                out.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=True))
            except Exception:  # a template that refuses a shape: the raw samples still check
                continue
    rust = tokenizer.backend_tokenizer
    added = [t.content for t in rust.get_added_tokens_decoder().values()][:16]
    # words of the tokenizer's own vocabulary, so a piece is not all unknown tokens
    vocab = sorted(set(rust.get_vocab()) - set(added))
    step = max(1, len(vocab) // 12)
    words = [w for w in (rust.decode([rust.token_to_id(v)]).strip() for v in vocab[::step]) if w]
    text = " ".join(words[:12])
    for tok in added:
        out += [tok, f"{tok}{tok}", f" {tok} x", f"x{tok}\n", f"word{tok}word", f"\n{tok}\n\n",
                f"{text}{tok}{text}", f"{text} {tok} {text}\n"]
        out += [f"{w} {w}{tok}{w} {w}" for w in words[:12]]  # each word at a piece's start
    out.append("".join(added) + " tail")
    return out


def checked(tokenizer: Any) -> tuple[PieceEncoder | None, str]:
    """A :class:`PieceEncoder` for ``tokenizer`` (mlx-lm's wrapper or a transformers fast
    tokenizer) if it gives the tokenizer's own ids on every sample, else None and why."""
    rust = getattr(tokenizer, "backend_tokenizer", None)
    if rust is None or not hasattr(rust, "get_added_tokens_decoder"):
        return None, "not a fast (HF tokenizers) tokenizer"
    try:
        enc = PieceEncoder(rust)
        for text in samples(tokenizer):
            want = list(tokenizer.encode(text, add_special_tokens=False))
            if enc.encode(text) != want:
                return None, f"piece-wise ids differ from the tokenizer's on {text[:60]!r}"
    except Exception as err:  # a tokenizer we cannot read this way: tokenize whole
        return None, f"{type(err).__name__}: {err}"
    return PieceEncoder(rust), ""  # a fresh one: the samples are nobody's prompt


class PromptTokenizer:
    """mlx-lm's tokenizer wrapper as the API process uses it, plus :meth:`encode_prompt`
    (a rendered prompt's ids, through the checked :class:`PieceEncoder` where there is
    one). Everything else is the wrapper's own."""

    def __init__(self, tokenizer: Any) -> None:
        self._wrapped = tokenizer
        self._pieces, self.pieces_refused = checked(tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)

    def __len__(self) -> int:
        return len(self._wrapped)

    def encode_prompt(self, text: str) -> list[int]:
        """``text``'s ids as ``encode(text, add_special_tokens=False)`` gives them."""
        if self._pieces is None:
            return list(self._wrapped.encode(text, add_special_tokens=False))
        return self._pieces.encode(text)

    def figures(self) -> dict[str, Any]:
        """What the status shows as ``prompt_pieces``."""
        if self._pieces is None:
            return {"enabled": False, "reason": self.pieces_refused}
        return {"enabled": True, **self._pieces.figures()}
