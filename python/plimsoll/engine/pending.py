"""A submitted step's outcome: the tokens it sampled, read back once.

:meth:`plimsoll.engine.core.Engine.run_async` returns a :class:`Pending`; its
:meth:`~Pending.result` settles every step submitted before it first, in order (the engine's
``_settle_until``), so a constraint is told its tokens in the order they were sampled. A
verifying step's drafts and checks are read back here too, and each speculating Work gets its
accepted prefix (:func:`plimsoll.engine.verify.accepted`).
"""

from __future__ import annotations

from plimsoll.engine import forward, verify


class Pending:
    """A submitted step; :meth:`result` blocks until its sampled tokens are known."""

    def __init__(self, engine, outs: list[forward.Out]):
        self._engine, self._outs = engine, outs
        self._result: dict[int, int | tuple[int, ...]] | None = None

    def _settle(self) -> dict[int, int | tuple[int, ...]]:
        if self._result is None:
            result: dict[int, int | tuple[int, ...]] = {}
            for works, tokens, verified in self._outs:
                for w, t in zip(works, [] if tokens is None else tokens.tolist(), strict=True):
                    result[w.seq_id] = t
                    if w.constraint is not None:
                        w.constraint.advance(t)
                if verified:  # the drafts read back too: a chained Work's are the engine's
                    checks, drafts, row = verified[1].tolist(), verified[2].tolist(), 0
                    for w in verified[0]:
                        rows = checks[row:row + w.draft + 1]
                        result[w.seq_id] = got = verify.accepted(drafts[row:row + w.draft],
                                                                 rows)
                        if w.lookup:  # its rejected drafts move its chain's reach back
                            self._engine.chains.settled(w.seq_id, w.draft + 1 - len(got))
                        row += w.draft + 1
            self._result, self._outs = result, []
        return self._result

    def result(self) -> dict[int, int | tuple[int, ...]]:
        """``{seq_id: token}`` for every Work of the step with ``sample=True``; for a
        speculating Work (``draft`` > 0) the tuple of tokens it accepted (1 or more)."""
        self._engine._settle_until(self)
        return self._settle()
