"""What a :class:`~plimsoll.engine.work.Step` must satisfy before the engine builds it.

A caller's bug (a sequence twice in a step, a table that does not cover its positions, a
decode of more than one token, a chained Work without its chain, drafts this engine cannot
verify) is a ``ValueError`` naming the sequence, raised before anything is written.
"""

from __future__ import annotations

from plimsoll.engine.work import Step


def check(eng, step: Step) -> None:
    """Raise ``ValueError`` for the first Work of ``step`` that ``eng`` (an
    :class:`~plimsoll.engine.core.Engine`) cannot run."""
    seen: set[int] = set()
    for w in (*step.decodes, *step.prefills):
        if w.seq_id in seen:
            raise ValueError(f"sequence {w.seq_id} appears twice in one step")
        seen.add(w.seq_id)
        if w.tokens is not None and not w.tokens:
            raise ValueError(f"sequence {w.seq_id}: a Work writes at least one token")
        if len(w.block_table) * eng.block_tokens < w.start + w.length:
            raise ValueError(f"sequence {w.seq_id}: a table of {len(w.block_table)} blocks "
                             f"does not cover positions up to {w.start + w.length}")
    for w in step.decodes:
        if w.length != 1:
            raise ValueError(f"sequence {w.seq_id}: a decode writes exactly one token")
        if w.tokens is None and w.seq_id not in eng._last:
            raise ValueError(f"sequence {w.seq_id}: tokens=None but nothing was sampled "
                             "for it in an earlier step")
    chains = any(w.lookup for w in step.prefills) and eng.chains_drafts
    for w in step.prefills:
        if w.tokens is None and not (w.chained and w.lookup
                                     and eng.chains.holds(w.seq_id)):
            raise ValueError(f"sequence {w.seq_id}: a prefill names its tokens (a "
                             "chained one follows a verifying step that drafts by lookup)")
        if w.tokens is None and w.start < (reach := eng.chains.reach(w.seq_id)):
            raise ValueError(f"sequence {w.seq_id}: a chained Work starts at the highest "
                             f"position its chain can reach ({reach}), not {w.start}")
        if w.lookup and not (w.draft and chains):
            raise ValueError(f"sequence {w.seq_id}: only a verifying Work on an engine "
                             "that chains drafts (Engine.chains_drafts) drafts by lookup")
        if w.lookup and w.tokens is not None and w.history is None:
            raise ValueError(f"sequence {w.seq_id}: a Work that begins a chain names "
                             "its history")
        if w.draft and (why := eng.speculation_refused or (
                "" if w.sample and w.constraint is None and w.draft == w.length - 1
                and (w.draft_probs is None or tuple(w.draft_probs.shape[:1]) == (w.draft,))
                else "only an unconstrained, sampling Work of one token and its drafts "
                "(and one distribution per draft, if any) is verified")):
            raise ValueError(f"sequence {w.seq_id}: drafts not verified: {why}")
