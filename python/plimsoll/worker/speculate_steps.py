"""Speculative decoding's steps in the scheduler (pure): whether the step in flight is read
before planning, a speculating sequence's Work, and what a verified step leaves.

Functions over a :class:`~plimsoll.worker.speculate.Drafter` (None: speculation off) and a
running sequence, called by :mod:`plimsoll.worker.scheduler` once a step in this order:
:func:`begin_step` (the retry clock), :func:`drafting_waits` (a sequence that may draft has
a token in flight that its drafts need: the previous step is read first — unless its next
step is planned on a prediction or chained on the device), :func:`prepare` (a draft model's
batched work), :func:`verify_work` (its drafts as the step's Work), :func:`planned_ahead`
(whether the step before must be read after this one is submitted), and for every step
read, :func:`settle` (its tokens, ``written`` set from them); :func:`timed` once the
iteration that submitted the step is over (what a verifying step costs, measured).
"""

from __future__ import annotations

from typing import Any

from plimsoll.engine.work import Work

from .speculate import Drafter, may_draft
from .waiting import Run


def begin_step(drafter: Drafter | None) -> None:
    """A step begins: the retry clock ticks (first thing in the scheduler's iteration)."""
    if drafter is not None:
        drafter.tick()


def timed(drafter: Drafter | None, step: Any, seconds: float) -> None:
    """The scheduler's iteration that submitted ``step`` took ``seconds`` (its plan, its
    submission, the reads it waited for): one sample of
    :class:`~.draft_costs.StepCosts`, unless the step prefills a prompt chunk."""
    if drafter is not None and drafter.on and all(w.draft for w in step.prefills):
        rows = len(step.decodes) + len(step.prefills)
        drafts = sum(w.draft for w in step.prefills)
        drafter.costs.add(rows, len(step.prefills), rows + drafts, seconds)


def prepare(drafter: Drafter | None, pool: Any, running: dict[int, Run]) -> None:
    """Before planning: the proposer's batched work for this step (a draft model's)."""
    if drafter is not None and drafter.on:
        drafter.prepare(pool, running)


def drafting_waits(drafter: Drafter | None, running: dict[int, Run]) -> bool:
    """Whether a sequence that may draft this step has a token in flight that its drafts
    need (the scheduler reads the previous step first), not one whose step's outcome it
    may assume (:func:`verify_work`'s lookahead)."""
    return drafter is not None and any(
        run.pending and not run.prefilling and drafter.following(run.req.id) is None
        and not drafter.chain_length(run)                                # chained on it
        and (may_draft(drafter, run) or run.req.id in drafter.inflight)  # never pipelined
        for run in running.values())                                     # on a step ahead


def verify_work(drafter: Drafter | None, pool: Any, run: Run) -> Work | None:
    """``run``'s drafts as a Work to verify, its table grown over them (None: it decodes
    plainly this step, or speculation is off). The drafts stop one short of ``max_tokens``,
    so they stay inside the reservation."""
    if drafter is None or not drafter.on or run.req.constraint is not None:
        return None
    if run.req.seed is not None:
        drafter.own_clock(run.req.id)
    sid, ahead = run.req.id, ()
    if run.pending and (k := drafter.chain_length(run)):  # drafted on the device
        drafter.started(sid, None, k, chained=True)
        drafter.figures.ahead += 1
        drafter.figures.chained += 1
        return Work(sid, None, run.written, pool.grow(sid, run.written + 1 + k), True,
                    run.sampling, None, draft=k, lookup=drafter.longest)
    if run.pending:
        ahead = drafter.following(sid)
        if ahead is None:  # a pipelined decode in flight: it does not draft this step
            return None
    # lookahead: a greedy sequence whose verifying step is in flight is planned on that
    # step yielding ``ahead`` (its drafts and lookup's next token after them), written
    # after it; if it yields other tokens this step's are dropped (settle). So a sequence
    # whose drafts keep being right is pipelined as a plain decode is.
    room = run.req.max_tokens - run.generated - len(ahead) - 1
    draft = drafter.propose(sid, run.tokens, room, ahead)
    if not draft and not ahead:
        return None
    table = pool.grow(sid, run.written + 1 + len(draft)) if draft else None
    if table is None:
        if not ahead:
            return None
        # planned ahead, it must name its token: the predicted one, no drafts (the scheduler
        # grew the table for one token already)
        draft, table = (), pool.grow(sid, run.written + 1)
    chains = drafter.chains_of(run) and not ahead
    expect = (drafter.expect(sid, run.tokens, ahead, draft)
              if run.sampling.greedy and room > len(draft) and not chains else None)
    drafter.started(sid, run.written, len(draft), expect)
    if ahead:
        drafter.figures.ahead += 1
    first = ahead[-1] if ahead else run.tokens[-1]
    if not draft:  # nothing to verify: the predicted token decoded, explicitly
        return Work(sid, (first,), run.written, table, True, run.sampling, None)
    # chains: the engine keeps its outcome, so the next step may be chained on it
    begins = {"lookup": drafter.longest, "history": drafter.history(sid, run.tokens)} \
        if chains else {}
    return Work(sid, (first, *draft), run.written, table, True, run.sampling, None,
                draft=len(draft), **begins)


def planned_ahead(drafter: Drafter | None, step: Any) -> bool:
    """Whether ``step`` holds a Work planned on the predicted tokens of the step in flight
    (that step must then be read after this one is submitted: :func:`settle` of a failed
    prediction rolls ``written`` back over the Work's writes, which submitting adds). A
    chained Work does not count: its step may be read before or after it is submitted."""
    return drafter is not None and any(
        len(flights := drafter.inflight.get(w.seq_id, ())) > 1 and not flights[-1].chained
        for w in (*step.decodes, *step.prefills))


def settle(drafter: Drafter | None, run: Run, out: int | tuple[int, ...]) -> tuple[int, ...]:
    """The tokens a step read back for ``run``: a plain decode's one, or a verifying step's
    accepted drafts and the target's next token, whose settling rolls ``written`` back to
    them and counts the request's drafted and accepted tokens. A step planned ahead on this
    one's predicted tokens stands if this one yielded them (``written`` then keeps its
    writes), else it is void: none of its tokens (read later) are emitted."""
    sid = run.req.id
    flights = drafter.inflight.get(sid) if drafter is not None else None
    if not flights:  # a plain decode
        return (out,) if isinstance(out, int) else out
    if flights[0].void:
        drafter.pop_flight(sid)
        drafter.figures.ahead_void += 1
        return ()
    out = (out,) if isinstance(out, int) else out
    expect = flights[0].expect
    if expect is not None:
        drafter.predicted(sid, out == expect)
    if flights[0].drafts:
        found = out.found if flights[0].chained else None  # engine/work.Accepted
        start, drafts = drafter.settle(sid, len(out) - 1, found)
        run.req.drafted += drafts if found is None else found
        run.req.accepted += len(out) - 1
    else:  # a predicted token decoded ahead
        start, drafts = drafter.pop_flight(sid).start, 0
    later = drafter.inflight.get(sid)
    if later and later[0].chained:  # drafted on the device after this: it stands
        later[0].start = start + len(out)
        # ``written`` counted this step's every draft (the highest the chain could reach),
        # whether or not the step chained on it is submitted yet: less what was rejected
        run.written -= drafts + 1 - len(out)
        return out
    if sid in drafter.inflight and out == expect:
        return out  # the step planned ahead on it stands: its writes too
    run.written = start + len(out)
    for later in drafter.inflight.get(sid, ()):
        later.void = True
    return out
