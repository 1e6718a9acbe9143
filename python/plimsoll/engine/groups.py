"""A step's groups and the views each cache layer gives them (imports mlx).

A step is cut into *groups*, each one call of every token-mixing module
(:mod:`plimsoll.engine.mixers`): the decode rows (one token each, batched as ``(rows, 1)``;
a verifying sequence's ``k + 1`` tokens are ``k + 1`` of them, see
:func:`plimsoll.engine.forward.rows_of_works`), then each prefill chunk (``(1, n)``, causal
from its start). A :class:`Group` carries its
:class:`~plimsoll.engine.attention.Batch` (slots written, blocks read, mask, rope offset),
its window rings' batch and its recurrent-state caches, and its rows ``lo .. hi`` in the
step's flattened ``(T, 1)`` layout. :class:`Flat` is that layout: the groups, every token's
position, and the per-group views the regrouped modules ask for.
"""

from __future__ import annotations

import mlx.core as mx

from plimsoll.engine import composite
from plimsoll.engine.paged import FullAttention, RecurrentState
from plimsoll.engine.window import WindowAttention, WindowView


class Group:
    """The decode rows of a step, or one prefill chunk: one call of each mixing module."""

    __slots__ = ("batch", "decode", "hi", "inputs", "lo", "rings", "rows", "states", "works")

    def __init__(self, works, lo: int, decode: bool, batch, rings, states: list, rows=None):
        self.works, self.lo, self.decode = tuple(works), lo, decode
        #: the decode rows, one token each (a verifying Work's ``k + 1`` rows in order);
        #: the works themselves where none verifies
        self.rows = self.works if rows is None else tuple(rows)
        self.hi = lo + (len(self.rows) if decode else self.works[0].length)
        self.batch, self.rings, self.states = batch, rings, states
        #: the rows' input tokens where the engine made some (chained Works: engine/chain.py)
        self.inputs: mx.array | None = None

    @property
    def length(self) -> int:
        """Tokens a row of this group holds: 1 for decode rows, the chunk's length."""
        return 1 if self.decode else self.hi - self.lo

    def sampled(self) -> list[int]:
        """Rows of the flattened layout whose logits are sampled."""
        if self.decode:
            return [self.lo + i for i, w in enumerate(self.rows) if w.sample]
        w = self.works[0]
        if w.draft:  # a speculating sequence: every row is verified
            return list(range(self.lo, self.hi))
        return [self.hi - 1] if w.sample else []

    def take(self, a: mx.array, batch: int, length: int) -> mx.array:
        """This group's part of ``a`` (the flattened rows on axis ``batch``, length 1 on
        ``length``): decode rows as they are, a chunk's tokens moved onto its length axis."""
        part = a[(slice(None),) * batch + (slice(self.lo, self.hi),)]
        return part if self.decode else mx.swapaxes(part, batch, length)

    def give(self, out: mx.array, batch: int, length: int) -> mx.array:
        """The inverse of :meth:`take` for a module's output."""
        return out if self.decode else mx.swapaxes(out, batch, length)


def group_view(kind, group: Group, state_index: dict[int, int]):
    """The cache object ``kind``'s layer hands its module for ``group``."""
    if isinstance(kind, composite.Composite):
        return composite.CompositeView([group_view(p, group, state_index) for p in kind.parts])
    if isinstance(kind, WindowAttention):
        return WindowView(kind, group.batch, group.rings)
    if isinstance(kind, RecurrentState):
        return group.states[state_index[id(kind)]]
    return composite.view_of(kind, group.batch, iter(()))


def fence(kind, after: list[mx.array]) -> None:
    """The next write into ``kind``'s pools waits for ``after`` (see FullAttention.fence)."""
    if isinstance(kind, composite.Composite):
        for p in kind.parts:
            fence(p, after)
    elif isinstance(kind, WindowAttention):
        kind.ring.fence(after)
    elif isinstance(kind, FullAttention):
        kind.fence(after)


def state_index(layers) -> dict[int, int]:
    """Each recurrent-state kind's index among the state kinds, in flatten order."""
    states = [k for k in composite.flatten(layers) if isinstance(k, RecurrentState)]
    return {id(k): j for j, k in enumerate(states)}


class Flat:
    """A step in the flattened ``(T, 1)`` layout (what :class:`mixers.StepView` reads)."""

    def __init__(self, groups: list[Group], states: dict[int, int]):
        self.groups, self._states = groups, states
        self.total = groups[-1].hi
        pos = []
        for g in groups:
            pos += ([w.start for w in g.rows] if g.decode
                    else range(g.works[0].start, g.works[0].start + g.length))
        self.positions = mx.array(pos, dtype=mx.int32)

    def view(self, kind, group: Group):
        return group_view(kind, group, self._states)

    def fence(self, kind, after: mx.array) -> None:
        fence(kind, [after])
