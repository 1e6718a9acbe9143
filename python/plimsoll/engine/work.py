"""The contract between the scheduler and the engine: pure value types, no mlx.

The scheduler (the pool's owner) decides which tokens are written where; the engine
only executes a :class:`Step` against physical blocks it is told about. Importing
this module never imports mlx, so the scheduler and its tests can use it without a
model. What a step holds beside the pool (its transients) is counted in
:mod:`plimsoll.core.transients`.

Positions inside a block table: the token at position ``p`` lives in block
``block_table[p // block_tokens]`` at offset ``p % block_tokens``. A block may sit
in several tables (a shared prefix); the engine only reads full shared blocks and
the scheduler never gives two sequences the same block to write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import numpy


@dataclass(frozen=True)
class Sampling:
    """How a sequence's next token is drawn: greedy at temperature 0; otherwise mlx-lm's
    filters (``top_p`` 1.0, ``top_k`` 0 and ``min_p`` 0.0 are off) and a draw at
    ``temperature``, from the sequence's own key when ``seed`` is given."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class TokenConstraint(Protocol):
    """Constrained decoding (json schema, tool_choice): a mask over the vocabulary."""

    def allowed(self) -> numpy.ndarray | None:
        """A bool mask over the vocabulary for the next token; None allows any."""
        ...

    def advance(self, token_id: int) -> None:
        """The token sampled for this sequence, told after each step."""
        ...

    def done(self) -> bool:
        """The grammar is finished: the sequence should stop."""
        ...


@dataclass(frozen=True)
class Work:
    """One sequence's share of a step.

    ``tokens`` are written at positions ``start .. start + len(tokens) - 1``. ``None``
    (decodes only) means "the token this engine sampled for ``seq_id`` in the previous
    step", still lazy on the device (pipelining).

    ``draft`` > 0 (a speculating sequence, unconstrained only): the last ``draft`` of
    ``tokens`` are proposals to verify; the Work runs as ``draft + 1`` decode rows from
    ``start`` (a chunk at ``start`` where a layer is not a plain full-attention pool:
    engine/forward.rows_of_works) with logits at every row, and its result is the accepted
    drafts plus the target's next token
    (1 .. ``draft`` + 1 tokens; :mod:`plimsoll.engine.verify`: the argmax's agreeing prefix
    when greedy, the rejection-sampling rule when sampled). Positions past the accepted ones
    are overwritten later. ``draft_probs``: the distributions the proposer drew its drafts
    from, an array (``draft``, vocab) of probabilities over the target's vocabulary; None
    when each draft is certain (a point mass, as prompt lookup's are).

    ``lookup`` = n > 0 (a verifying Work drafted by prompt lookup, on an engine whose
    :attr:`~plimsoll.engine.core.Engine.chains_drafts`): the engine keeps the sequence's
    outcome on the device (:mod:`plimsoll.engine.chain`), so its next Work may be *chained*:
    ``tokens`` None and ``draft`` = k, its input the token this one ends with and k drafts
    the engine finds by n-gram lookup, at the position this one leaves (``start`` is then
    the highest that position can be; the table covers ``start + k + 1``). A Work that
    begins a chain names the sequence's tokens at positions ``0 .. start`` in ``history``.
    """

    seq_id: int
    tokens: tuple[int, ...] | None
    start: int
    block_table: tuple[int, ...]
    sample: bool
    sampling: Sampling = Sampling()
    constraint: TokenConstraint | None = None
    draft: int = 0
    draft_probs: object | None = field(default=None, compare=False, repr=False)
    lookup: int = 0
    history: object | None = field(default=None, compare=False, repr=False)

    @property
    def length(self) -> int:
        """Tokens this Work writes (one for a pipelined decode; a chained one's drafts and
        the token before them)."""
        return (self.draft + 1) if self.tokens is None else len(self.tokens)

    @property
    def chained(self) -> bool:
        """Whether its tokens are the engine's own (:mod:`plimsoll.engine.chain`)."""
        return self.tokens is None and self.draft > 0


@dataclass(frozen=True)
class Step:
    """Everything one engine step runs, as ONE forward of the model: every decode (one token)
    and every prefill chunk, at any start (engine/forward.py)."""

    decodes: tuple[Work, ...] = ()
    prefills: tuple[Work, ...] = ()


class Accepted(tuple):
    """What a verifying Work yields (its accepted drafts, then the target's token), and
    ``found``: how many of its drafts existed (a chained Work's drafts that the device rule
    did not find are -1: verified rows, never proposals)."""

    found: int

    def __new__(cls, tokens, found: int):
        out = super().__new__(cls, tokens)
        out.found = found
        return out
