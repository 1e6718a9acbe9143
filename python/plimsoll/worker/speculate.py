"""Speculative decoding's side of the scheduler (pure): what to propose, how much, and what a
verified step leaves.

A speculating sequence's step verifies its drafts in the one forward
(:class:`~plimsoll.engine.work.Work` with ``draft`` > 0): its last sampled token and ``k``
proposed tokens, logits at all ``k + 1`` rows (:mod:`plimsoll.engine.verify`). A greedy
sequence accepts the longest prefix of drafts equal to the target's argmax, plus the target's
next token, so its output is the target's alone; a sampled one (temperature > 0) accepts by
the rejection-sampling rule (a draft ``x`` with probability ``p(x)`` under the distribution
the plain sampler draws from, the token after the accepted prefix drawn from ``p`` without
the rejected draft), so its tokens follow the target's distribution, and its seed reproduces
them. Constrained sequences decode plainly (a row's mask needs each previous token).

- proposers: a draft model (:mod:`.draft_model`, overriding :meth:`Drafter.prepare` and
  :meth:`Drafter.lookup`) or :func:`prompt_lookup`, which proposes by n-gram matching
  (mlx-lm / vLLM style): the sequence's last ``n`` tokens (``n`` from the longest down to 1)
  at their most recent earlier place in the prompt and the output so far; the tokens that
  followed there are the drafts.
- :class:`Drafter` keeps each sequence's draft length: it starts at ``most``, or shorter
  where the drafts verified so far were mostly rejected (:func:`start_length`: a proposer
  that keeps failing costs a new sequence one short retry, not ``most`` longer steps, nor a
  draft model's prefill of its whole prompt); one fewer after a step that found no match; 0
  after a verifying step where the sequence's drafts no longer pay
  (:func:`~.draft_costs.pays`: its estimated chance that a draft is right,
  :meth:`Drafter.rate`, against what its drafts cost in the batch as it runs, measured while
  serving, :mod:`.draft_costs`; an unlucky step of a proposer that is right 80 % of the time
  does not shorten it; a retry's outcome is judged hopefully, its rate one standard error
  up); else one more after a step that accepted everything (up to ``most``). At 0 the
  sequence decodes plainly (and pipelined) and tries one draft again every
  :data:`RETRY_STEPS` steps (four times as many where drafts have failed nearly everywhere,
  :func:`start_wait`; twice as many after each retry that accepted nothing, up to
  :data:`MAX_RETRY_STEPS`). Retries keep one clock (:meth:`Drafter.tick`, once a step): a
  sequence retries at the steps that are multiples of its interval, and the intervals are
  powers of two, so sequences whose drafts keep failing retry in the same step: the step is
  unpipelined (its drafts need the previous token) once, not once per sequence. A seeded
  sequence keeps its own clock instead (from its first decode step): which steps verify
  drafts decides its random draws, and its seed reproduces its tokens alone or batched.
  Its counters are the status's ``speculative`` figures.
- The scheduler's side, as functions over the drafter and a sequence, is
  :mod:`.speculate_steps` (the previous step read before planning or not, the drafts as the
  step's Work, a verified step's tokens read back and ``written`` set from them).
- Lookahead (prompt lookup, greedy): each verifying step carries a prediction of what it
  yields (:class:`Flight`'s ``expect``: its drafts, then lookup's next token); once
  :data:`AHEAD_AFTER` in a row came true, the sequence's next step is planned on the
  prediction while the step runs (pipelined, as a plain decode is), and dropped when read
  if the prediction failed (``settle`` marks it void; ``written`` rolled back).
- Chained (prompt lookup on an engine that chains: :attr:`Drafter.chains`): the engine keeps
  a verifying step's outcome on the device and drafts the sequence's next step itself
  (:mod:`plimsoll.engine.chain`), so that step is planned before the one in flight is read,
  whatever it accepts (:meth:`Drafter.chain_length`).

Drafts never pass the reservation: ``k`` is at most the tokens the request may still
generate less one, so the last drafted position is below ``prompt + max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .draft_costs import VERIFY_COST, StepCosts, pays
from .ngram import History, prompt_lookup
from .waiting import Run

#: a sequence at draft length 0 tries one draft again at every step whose number is a
#: multiple of this; each retry that accepts nothing doubles it, up to MAX_RETRY_STEPS (one
#: that accepts resets it): where drafts stay wrong, what the retries cost shrinks towards
#: nothing. Powers of two: the retries of sequences at different intervals still coincide
RETRY_STEPS = 16
MAX_RETRY_STEPS = 256
#: a greedy sequence's next step is planned ahead of its verifying step in flight once this
#: many of its verifying steps in a row yielded the tokens predicted for them (drafts right
#: in runs, as where an agent quotes a file back); a prediction that fails ends the run
AHEAD_AFTER = 3
#: a sequence's estimate of its drafts' chance of being right (:meth:`Drafter.rate`) weighs
#: its own verified drafts, each older step's by DECAY less, against this many drafts at
#: every sequence's rate so far (the figures)
PRIOR_DRAFTS = 4
DECAY = 0.85


@dataclass
class Flight:
    """A speculating sequence's step in flight (submitted, not read yet)."""

    #: where its Work writes (a chained one's: known once the step before it is read)
    start: int | None
    drafts: int  # the drafts it verifies
    #: the tokens it yields if every draft is accepted and the target's next token is the one
    #: lookup predicts after them; a step planned before this one is read assumes them
    #: (:func:`verify_work`'s lookahead). None: nothing may be planned on it
    expect: tuple[int, ...] | None = None
    #: planned on the step before's ``expect``, which that step did not yield: its tokens
    #: are dropped when read (its positions are written again later)
    void: bool = False
    #: drafted by the engine from the step before's outcome on the device (engine/chain.py)
    chained: bool = False


@dataclass
class Figures:
    """One proposer's counts: tokens proposed and accepted, verifying steps, and the steps
    planned ahead of the step before's tokens (``ahead``; ``ahead_void``: dropped because
    the step before yielded other tokens than predicted)."""

    proposed: int = 0
    accepted: int = 0
    #: verifying steps that rejected a draft (a step stops at its first wrong draft: a
    #: draft's chance of being right is accepted / (accepted + rejected))
    rejected: int = 0
    steps: int = 0
    ahead: int = 0
    ahead_void: int = 0
    chained: int = 0  # of ``ahead``: drafted by the engine on the device

    def report(self) -> dict[str, float | int]:
        return {"proposed": self.proposed, "accepted": self.accepted, "steps": self.steps,
                "ahead": self.ahead, "ahead_void": self.ahead_void, "chained": self.chained,
                "acceptance_rate": round(self.accepted / self.proposed, 4)
                if self.proposed else 0.0,
                "accepted_per_step": round(self.accepted / self.steps, 4)
                if self.steps else 0.0}


def start_length(most: int, figures: Figures) -> int:
    """A new sequence's draft length: ``most``; 1 where fewer than half the drafts verified so
    far were accepted (its length grows by one per step that accepts every draft); 0, a
    retry at the next retry step, where fewer than a quarter were (a draft model's retry
    catches up only the prompt's last tokens: a proposer that keeps failing does not prefill
    every prompt)."""
    if not figures.proposed or 2 * figures.accepted >= figures.proposed:
        return most
    return min(1, most) if 4 * figures.accepted >= figures.proposed else 0


def start_wait(figures: Figures) -> int:
    """A sequence's retry interval before any retry of its own: :data:`RETRY_STEPS`; four
    times that where at least 16 drafts were verified and fewer than one in 16 accepted (a
    proposer that fails everywhere, an MTP head on random weights: a 160-token answer then
    retries twice, not four times). A retry that accepts resets every sequence it helps."""
    if figures.proposed >= 16 and 16 * figures.accepted < figures.proposed:
        return 4 * RETRY_STEPS
    return RETRY_STEPS


@dataclass
class Drafter:
    """Prompt lookup with a per-sequence adaptive draft length (see the module docstring).
    A proposer of another kind (:class:`plimsoll.worker.draft_model.DraftModel`) overrides
    :meth:`lookup` and :meth:`prepare`."""

    proposer = "prompt_lookup"  # the status's name for it (by_proposer)
    #: whether a greedy sequence's next step may be planned on the predicted outcome of its
    #: step in flight (prompt lookup: its drafts cost nothing to make twice); a proposer with
    #: a model of its own (a draft model, an MTP head) drafts from state that must be read
    looks_ahead = True
    longest: int  # the longest n-gram matched (--prompt-lookup)
    most: int     # the longest draft (--num-draft-tokens)
    refused: str = ""  # why this engine does not speculate ("" when it does)
    #: the engine drafts an unseeded sequence's next step on the device from its verifying
    #: step in flight (engine/chain.py; Engine.chains_drafts): lookahead at any acceptance
    chains: bool = False
    figures: Figures = field(default_factory=Figures)
    costs: StepCosts = field(default_factory=StepCosts)
    clock: int = 0  # the step being planned (tick): retries happen on its multiples
    _length: dict[int, int] = field(default_factory=dict)
    _wait: dict[int, int] = field(default_factory=dict)  # its retry interval, where backed off
    _origin: dict[int, int] = field(default_factory=dict)  # a seeded sequence's own clock
    #: seq id -> its steps in flight that verify drafts or were planned ahead, oldest first
    inflight: dict[int, list[Flight]] = field(default_factory=dict)
    _history: dict[int, History] = field(default_factory=dict)  # prompt lookup's arrays
    #: seq id -> how many of its last verifying steps in a row yielded their ``expect``
    _streak: dict[int, int] = field(default_factory=dict)
    #: seq id -> its drafts accepted and its steps that rejected one, each older step's
    #: weighed by DECAY less (:meth:`rate`)
    _verified: dict[int, tuple[float, float]] = field(default_factory=dict)

    @property
    def on(self) -> bool:
        return not self.refused

    def wants(self, seq_id: int) -> bool:
        """Whether ``seq_id`` may draft at its next step, or has drafts in flight (either
        way its next step needs its tokens read: it is not pipelined)."""
        return seq_id in self.inflight or self._current(seq_id) > 0 \
            or self._due(seq_id, self.clock)

    def tick(self) -> None:
        """A step is about to be planned (:func:`begin_step`, once a step, before anything
        asks :meth:`wants`)."""
        self.clock += 1

    def own_clock(self, seq_id: int) -> None:
        """``seq_id`` (seeded) counts its retry steps from now, not on the shared clock."""
        self._origin.setdefault(seq_id, self.clock - 1)

    def _due(self, seq_id: int, step: int) -> bool:
        """Whether step ``step`` is a retry step for ``seq_id`` (at draft length 0)."""
        step -= self._origin.get(seq_id, 0)
        return step > 0 and step % self._retry(seq_id) == 0  # 0: no step planned yet

    def _current(self, seq_id: int) -> int:
        """``seq_id``'s draft length, set at its first use (:func:`start_length`)."""
        if seq_id not in self._length:
            self._length[seq_id] = start_length(self.most, self.figures)
        return self._length[seq_id]

    def retrying(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is at draft length 0 (a draft it makes is a retry)."""
        return self._current(seq_id) == 0

    def rate(self, seq_id: int, hopeful: bool = False) -> float:
        """``seq_id``'s estimated chance that a draft is right: its own verified drafts
        (decayed) and :data:`PRIOR_DRAFTS` drafts at every sequence's rate so far (one half
        before any). ``hopeful``: one standard error higher (a retry's outcome is judged
        on what the drafts may be: it is how a sequence at 0 finds out)."""
        f = self.figures
        prior = (f.accepted + 1) / (f.accepted + f.rejected + 2)
        right, wrong = self._verified.get(seq_id, (0.0, 0.0))
        weight = right + wrong + PRIOR_DRAFTS
        rate = (right + PRIOR_DRAFTS * prior) / weight
        return min(1.0, rate + (rate * (1 - rate) / weight) ** 0.5) if hopeful else rate

    def cost(self, seq_id: int | None = None) -> float:
        """What a sequence's drafts (:attr:`most`) cost in the batch as it runs, in the
        tokens it must yield a step (:meth:`StepCosts.cost`; a verifying row yields its
        accepted drafts and one more, on average so far). A seeded sequence's: always
        :data:`~.draft_costs.VERIFY_COST` (which steps verify decides its draws: its seed
        reproduces its tokens whatever the machine's timings and the batch)."""
        if seq_id in self._origin:
            return VERIFY_COST
        f = self.figures
        return self.costs.cost(self.most, 1 + f.accepted / f.steps if f.steps else 1.0)

    def _retry(self, seq_id: int) -> int:
        return self._wait.get(seq_id, start_wait(self.figures))

    def _back_off(self, seq_id: int) -> None:
        """A retry accepted nothing: the next waits twice as long."""
        self._wait[seq_id] = min(MAX_RETRY_STEPS, 2 * self._retry(seq_id))

    def length(self, seq_id: int) -> int:
        """The drafts :meth:`propose` will ask for ``seq_id`` now (before ``room``); changes
        nothing but a new sequence's start length, fixed here at its first use."""
        k = self._current(seq_id)
        if k == 0:
            return 1 if self._due(seq_id, self.clock) else 0
        return k

    def prepare(self, pool: Any, running: dict[int, Run]) -> None:
        """Before a step is planned: work every sequence's proposal needs done at once
        (nothing for prompt lookup)."""

    def lookup(self, seq_id: int, tokens: Sequence[int], k: int,
               ahead: Sequence[int] = ()) -> tuple[int, ...]:
        """Up to ``k`` drafts following ``tokens`` and then ``ahead`` (tokens assumed, not
        read yet: :class:`Flight`'s ``expect``)."""
        history = self._history.get(seq_id)
        if history is None:
            history = self._history[seq_id] = History()
        history = history.of(tokens)
        if ahead:
            history = np.concatenate([history, np.asarray(ahead, dtype=history.dtype)])
        return prompt_lookup(history, self.longest, k)

    def history(self, seq_id: int, tokens: Sequence[int]) -> np.ndarray:
        """``tokens`` as int32 (a copy): a chain's history on the device begins with it."""
        held = self._history.get(seq_id)
        if held is None:
            held = self._history[seq_id] = History()
        return held.of(tokens).astype(np.int32)

    def expect(self, seq_id: int, tokens: Sequence[int], ahead: Sequence[int],
               draft: Sequence[int]) -> tuple[int, ...] | None:
        """What a step verifying ``draft`` after ``tokens`` + ``ahead`` yields if it accepts
        every draft and the target's next token is lookup's next one; None where nothing
        predicts that token (or this proposer does not look ahead)."""
        if not self.looks_ahead or not draft:
            return None
        after = self.lookup(seq_id, tokens, 1, (*ahead, *draft))
        return (*draft, after[0]) if after else None

    def propose(self, seq_id: int, tokens: Sequence[int], room: int,
                ahead: Sequence[int] = ()) -> tuple[int, ...]:
        """The drafts for ``seq_id``'s next step (``room``: tokens it may still draft), after
        ``tokens`` and the ``ahead`` tokens a step in flight is assumed to yield."""
        k = retry = self._current(seq_id)
        if k == 0:
            if not self._due(seq_id, self.clock):
                return ()
            k = 1
        draft = self.lookup(seq_id, tokens, min(k, room), ahead) if room > 0 else ()
        if not draft and room > 0:
            self._length[seq_id] = k - 1
            if retry == 0:
                self._back_off(seq_id)  # a retry that found nothing to draft
        return draft

    def started(self, seq_id: int, start: int | None, drafts: int,
                expect: tuple[int, ...] | None = None, chained: bool = False) -> None:
        self.inflight.setdefault(seq_id, []).append(
            Flight(start, drafts, expect, chained=chained))

    def chains_of(self, run: Run) -> bool:
        """Whether ``run``'s verifying steps leave their outcome on the device for the next
        (prompt lookup on an engine that chains; unseeded: a seeded sequence's draws follow
        the steps that verify, which must not depend on when its tokens are read)."""
        return self.chains and self.looks_ahead and run.req.seed is None

    def chain_length(self, run: Run) -> int:
        """The drafts of ``run``'s next step chained on its verifying step in flight (0: it
        is not: its tokens are read first). Its drafts stop one short of ``max_tokens``
        however many the step in flight yields, so they stay inside the reservation."""
        flights = self.inflight.get(run.req.id)
        if not (run.pending and flights and len(flights) == 1 and flights[0].drafts
                and not flights[0].void and self.chains_of(run)):
            return 0
        room = run.req.max_tokens - run.generated - (flights[0].drafts + 1) - 1
        k = min(self._current(run.req.id), room)
        return k if k > 0 and run.written + 1 + k <= run.prompt_len + run.req.max_tokens \
            else 0

    def following(self, seq_id: int) -> tuple[int, ...] | None:
        """The tokens ``seq_id``'s step in flight is assumed to yield, where its next step may
        be planned on them: its last :data:`AHEAD_AFTER` predictions came true (a step
        planned on a wrong one is a step of the device's time for nothing). None: the step
        in flight must be read first."""
        flights = self.inflight.get(seq_id)
        if not flights or flights[-1].void or self._streak.get(seq_id, 0) < AHEAD_AFTER:
            return None
        return flights[-1].expect

    def predicted(self, seq_id: int, right: bool) -> None:
        """A verifying step's tokens were (or were not) the ones predicted for it."""
        self._streak[seq_id] = self._streak.get(seq_id, 0) + 1 if right else 0

    def pop_flight(self, seq_id: int) -> Flight:
        """``seq_id``'s oldest step in flight, now read."""
        flights = self.inflight[seq_id]
        flight = flights.pop(0)
        if not flights:
            del self.inflight[seq_id]
        return flight

    def settle(self, seq_id: int, accepted: int, found: int | None = None) -> tuple[int, int]:
        """``seq_id``'s verifying step accepted ``accepted`` drafts: count them, adapt its
        length; returns the step's start position and the drafts it was planned with.
        ``found``: a chained step's drafts that existed (the rest were rows the device rule
        found nothing for): they are what was proposed."""
        flight = self.pop_flight(seq_id)
        start, drafts = flight.start, flight.drafts if found is None else found
        k = self._current(seq_id)
        rejected = int(accepted < drafts)
        right, wrong = self._verified.get(seq_id, (0.0, 0.0))
        self._verified[seq_id] = (DECAY * right + accepted, DECAY * wrong + rejected)
        rate = self.rate(seq_id, hopeful=k == 0)
        if not drafts or not pays(rate, self.most, self.cost(seq_id)):
            self._length[seq_id] = 0  # found nothing (chained), or drafts that do not pay
        elif accepted == drafts:
            self._length[seq_id] = min(self.most, max(k, drafts) + 1)
        if accepted:
            self._wait.pop(seq_id, None)
        elif k == 0:  # a retry (its length stays 0 while it drafts one)
            self._back_off(seq_id)
        self.figures.proposed += drafts
        self.figures.accepted += accepted
        self.figures.rejected += rejected
        self.figures.steps += 1
        return start, flight.drafts

    def forget(self, seq_id: int) -> None:
        """``seq_id`` ended: drop its state."""
        self._length.pop(seq_id, None)
        self._wait.pop(seq_id, None)
        self._origin.pop(seq_id, None)
        self.inflight.pop(seq_id, None)
        self._history.pop(seq_id, None)
        self._streak.pop(seq_id, None)
        self._verified.pop(seq_id, None)

    def report(self) -> dict:
        """The status's ``speculative`` figures."""
        if self.refused:
            return {"enabled": False, "reason": self.refused}
        figures = self.figures.report()
        return {"enabled": True, "proposer": self.proposer, "prompt_lookup": self.longest,
                "num_draft_tokens": self.most, **figures,
                "verify_cost": round(self.costs.ratio(), 3),
                "draft_cost": round(self.cost(), 3),
                "by_proposer": {self.proposer: figures},
                "speculates": "unconstrained sequences, greedy and sampled (constrained "
                              "ones decode plainly)"}


def may_draft(drafter: Drafter, run: Run) -> bool:
    """Whether ``run`` may draft at its next step: unconstrained, its length > 0."""
    return drafter.on and run.req.constraint is None and drafter.wants(run.req.id)
