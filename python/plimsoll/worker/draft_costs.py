"""What drafts cost, measured while serving (pure): whether a sequence's drafts pay.

A sequence's ``k`` drafts, each right with probability ``p`` (a step accepts up to its first
wrong one), yield ``1 + p + … + p^k`` tokens a step where a plain step yields one
(:func:`pays`). What they cost depends on the batch they ride in:

- where they alone make the step a verifying one (one stream; or every other sequence
  decodes plainly), the step costs what a verifying step costs in plain ones, row for row,
  as served (:meth:`StepCosts.ratio`): unpipelined where its drafts wait for the step
  before;
- where other sequences verify drafts in the same step anyway, only their tokens' share of
  the step: ``k`` tokens at the step's cost per token (the slope of the verifying steps'
  time against their tokens, :meth:`StepCosts.line`), paid by every token the batch makes
  in that time (:meth:`StepCosts.cost`). On a GPU, where a few more rows of a batch cost
  nearly nothing, drafts right a third of the time pay; on a CPU, where a batch's time is
  its tokens' arithmetic, only drafts that are mostly right do. Unless the batch as a
  whole makes its tokens slower than decoding plainly would (:meth:`StepCosts.batch_pays`):
  then each sequence's drafts cost a whole verifying step, and the batch falls back to
  plain decoding rather than each sequence staying because the others do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import StatisticsError, fmean, linear_regression, median
from typing import Any

#: what a verifying step costs, in plain decode steps, until :class:`StepCosts` has
#: measured it (it is not pipelined where its drafts need the step before's tokens). Served
#: on the H200, one stream, full acceptance: 2.2 x at k = 1, 3 and 5
#: (speculative-h200-2026-12-04-curve), 1.8 x at k = 3 in another run; the CPU box: 2.7 x
#: at k = 3 (speculative-cpu-2026-12-05-pays)
VERIFY_COST = 2.0
MAX_COST = 4.0  # a measured cost is taken up to this (an outlier of a loaded machine)
#: :class:`StepCosts` keeps each kind's last TIMED_STEPS iterations and measures once a
#: kind has MIN_TIMED
TIMED_STEPS = 32
MIN_TIMED = 8
#: the verifying steps' tokens must spread this much (their standard deviation) for their
#: times to give a cost per token (a batch whose every row drafts ``k`` gives none)
MIN_SPREAD = 1.0


def pays(right: float, k: int, cost: float = VERIFY_COST) -> bool:
    """Whether verifying ``k`` drafts, each right with probability ``right`` (a step accepts
    up to its first wrong one), yields at least ``cost`` tokens a step (what the drafts
    cost, in the tokens a plain step yields, one): ``1 + right + right² + … + right^k``."""
    return sum(right ** i for i in range(k + 1)) >= cost


@dataclass
class StepCosts:
    """The scheduler's iterations timed (:func:`plimsoll.worker.speculate_steps.timed`):
    those whose step verified drafts and those whose step decoded plainly, neither with a
    prompt chunk; and the last one's rows."""

    #: (rows, query tokens, seconds) of the last verifying iterations; (rows, seconds) of
    #: the last plain ones
    verifying: deque = field(default_factory=lambda: deque(maxlen=TIMED_STEPS))
    plain: deque = field(default_factory=lambda: deque(maxlen=TIMED_STEPS))
    rows: int = 1       # the last timed iteration's sequences
    verifiers: int = 0  # of which verified drafts
    #: what line(), ratio() and cost() derive, since the last add (settle asks once per
    #: verifying row a step)
    _memo: dict = field(default_factory=dict, repr=False)

    def add(self, rows: int, verifiers: int, tokens: int, seconds: float) -> None:
        """An iteration of ``rows`` sequences, ``verifiers`` of them verifying drafts,
        ``tokens`` query tokens in all, took ``seconds``."""
        self.rows, self.verifiers = rows, verifiers
        if verifiers:
            self.verifying.append((rows, tokens, seconds))
        else:
            self.plain.append((rows, seconds))
        self._memo.clear()

    def _once(self, name: str, derive: Callable[[], Any]) -> Any:
        if name not in self._memo:
            self._memo[name] = derive()
        return self._memo[name]

    def line(self) -> tuple[float, float] | None:
        """A verifying step's seconds as ``fixed + per_token × tokens`` (least squares over
        the verifying iterations; ``per_token`` between 0 and their mean time per token);
        None until there are :data:`MIN_TIMED` whose tokens spread :data:`MIN_SPREAD`."""
        return self._once("line", self._line)

    def _line(self) -> tuple[float, float] | None:
        if len(self.verifying) < MIN_TIMED:
            return None
        _, tokens, seconds = zip(*self.verifying, strict=True)
        mean = fmean(tokens)
        if fmean((t - mean) ** 2 for t in tokens) < MIN_SPREAD ** 2:
            return None
        try:
            slope = linear_regression(tokens, seconds).slope
        except StatisticsError:
            return None
        slope = min(max(slope, 0.0), fmean(seconds) / mean)
        return fmean(seconds) - slope * mean, slope

    def ratio(self) -> float:
        """What a verifying step costs in plain ones, row for row, between 1 and
        :data:`MAX_COST`: the ratio of each kind's median time per row where each has
        :data:`MIN_TIMED` iterations; else, where plain steps are rare (every row drafts),
        a plain step is taken as the verifying steps' :meth:`line` at one token a row;
        else :data:`VERIFY_COST`."""
        return self._once("ratio", self._ratio)

    def _ratio(self) -> float:
        if len(self.verifying) >= MIN_TIMED and len(self.plain) >= MIN_TIMED:
            ratio = median(s / r for r, _, s in self.verifying) / \
                median(s / r for r, s in self.plain)
        elif (line := self.line()) is not None:
            fixed, slope = line
            rows, tokens, _ = (median(x) for x in zip(*self.verifying, strict=True))
            ratio = (fixed + slope * tokens) / max(fixed + slope * rows, 1e-9)
        else:
            ratio = VERIFY_COST
        return min(MAX_COST, max(1.0, ratio))

    def cost(self, k: int, yields: float) -> float:
        """What ``k`` more drafts in a step cost, in tokens the drafting sequence must
        yield (:func:`pays`' ``cost``). Where other sequences verify in the same step
        (the last iteration's), a cost per token is known and the batch's drafting pays
        (:meth:`batch_pays`): 1 + the tokens the batch yields a step (``yields`` per
        verifying row, one per plain row) over the step's time, times the ``k`` tokens'
        time. Otherwise what a verifying step costs (:meth:`ratio`)."""
        line = self.line()
        made = self.rows + self.verifiers * (yields - 1)
        if self.verifiers < 2 or line is None or not self.batch_pays(made):
            return self.ratio()
        step = self._once("step", lambda: median(s for _, _, s in self.verifying))
        return min(MAX_COST, 1.0 + made * line[1] * k / step)

    def batch_pays(self, made: float) -> bool:
        """Whether the last iteration's batch, yielding ``made`` tokens a verifying step,
        makes them faster than its rows decoding plainly would (:meth:`ratio`). Where it
        does not, its drafts cost each sequence a whole verifying step: each alone would
        see its share of the step nearly free, and all would keep the batch verifying (the
        CPU's 8 streams)."""
        return made >= self.rows * self.ratio()
