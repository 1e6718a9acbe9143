"""The grammar of a :class:`~.spec.Spec` as a token constraint, through llguidance.

:class:`Constrainer` is built once per tokenizer (llguidance's token trie over the
``tokenizers`` tokenizer.json: ~20-70 ms for the demo's 4k vocabulary, about a second for
a 150k one, so never per request). :meth:`Constrainer.constraint` compiles one request's
grammar (~2 ms for a realistic schema) into a :class:`GrammarConstraint`, which the engine
asks for the allowed-token mask before each sample and tells the sampled token after.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from .spec import Spec, SpecError, ToolMarkup, lark

log = logging.getLogger("plimsoll.constrain")
JSON_TOOLS = "mlx_lm.tool_parsers.json_tools"
"""The tool parser whose format (``{"name", "arguments"}`` JSON between markers) we force."""


class GrammarConstraint:
    """One request's grammar state: implements the engine's ``TokenConstraint``.

    The next mask is computed once per token, in :meth:`advance` (and at construction),
    so :meth:`allowed` and :meth:`done` cost nothing. ``done()`` is true once the grammar
    cannot continue (llguidance stops the matcher after the last byte it allows) or the
    matcher is in error (a token it did not allow: the engine must not be told to go on).
    """

    def __init__(self, matcher: Any, vocab: int):
        self._m = matcher
        self._vocab = vocab
        self._mask: np.ndarray | None = None
        self._refresh()

    def _refresh(self) -> None:
        if self._m.is_stopped() or self._m.is_error():
            self._mask = None
            return
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        self._mask = np.unpackbits(bits, bitorder="little")[:self._vocab].astype(bool)

    def allowed(self) -> np.ndarray | None:
        return self._mask

    def advance(self, token_id: int) -> None:
        if not self._m.consume_token(int(token_id)):
            log.warning("constraint: token %d was refused: %s", token_id, self._m.get_error())
        self._refresh()

    def done(self) -> bool:
        return self._m.is_stopped() or self._m.is_error()

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


class Constrainer:
    """llguidance over one mlx-lm tokenizer: grammars to constraints, and the tool markup."""

    def __init__(self, tokenizer: Any):
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the HF one
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        self.tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=eos)
        self.vocab = self.tokenizer.vocab_size
        self.markup = self._markup(tokenizer)

    def _atom(self, text: str, encode: Any) -> str:
        ids = encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"  # one added token: force that token, as the template does
        return json.dumps(text)

    def _markup(self, tokenizer: Any) -> ToolMarkup | None:
        parser = getattr(tokenizer, "tool_parser", None)
        if not getattr(tokenizer, "has_tool_calling", False) or parser is None:
            return None
        if getattr(parser, "__module__", "") != JSON_TOOLS:
            log.warning("constrain: tool-call format %s is not one this worker can force; "
                        "forced tool choices are rendered but not enforced",
                        getattr(parser, "__module__", parser))
            return None
        return ToolMarkup(self._atom(tokenizer.tool_call_start, tokenizer.encode),
                          self._atom(tokenizer.tool_call_end, tokenizer.encode))

    def grammar(self, spec: Spec) -> str:
        return lark(spec, self.markup)

    def constraint(self, spec: Spec) -> GrammarConstraint:
        """A fresh constraint for ``spec``; :class:`SpecError` when the grammar is refused."""
        grammar = self.grammar(spec)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise SpecError(f"the schema cannot be enforced: {matcher.get_error()}")
        return GrammarConstraint(matcher, self.vocab)
