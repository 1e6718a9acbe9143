"""The one forward of a step: its groups, one model call, sampling where it samples (imports mlx).

:func:`groups_of` cuts a :class:`~plimsoll.engine.work.Step` into groups
(:mod:`plimsoll.engine.groups`): every decode row as one group, then each prefill chunk at
any start (a first chunk, a chunk after a prefix hit, a later chunk of a long prompt). The
step then runs as ONE call of the model (:func:`run`):

- one group: in its own layout, ``(rows, 1)`` decode rows or a ``(1, n)`` chunk, each layer
  handed the group's views directly (nothing is regrouped);
- several groups: the ``(T, 1)`` layout of :mod:`plimsoll.engine.mixers`, each layer a
  :class:`~plimsoll.engine.mixers.StepView` that the model's token-mixing modules split
  into the groups' own calls;
- a model whose mixing modules could not be found (:attr:`Engine.mixers`'s reason) runs
  one forward per group instead, each submitted on its own.

Logits are taken only at each sequence's last scheduled token that samples (a decode row,
a chunk's last token): the last decoder layer's output is cut to those rows
(:mod:`plimsoll.engine.sampled_rows`), so no forward runs for a sampled token alone
and the lm head sees only the sampled rows. A speculating sequence's Work (``draft`` > 0)
has every row sampled — its ``k + 1`` tokens decode rows of the step
(:func:`rows_of_works`; a chunk of its own where a layer is not a plain full-attention
pool): all such rows of a step are checked at once
(:mod:`plimsoll.engine.verify`: greedy by the argmax, sampled by the rejection-sampling
rule), and :class:`~plimsoll.engine.pending.Pending` takes each one's accepted prefix. A
*chained* verifying Work (``tokens`` None: :mod:`plimsoll.engine.chain`) has its rows' tokens,
positions and pool slots made on the device from its chain, and every verifying Work that
drafts by lookup leaves its chain for the next step. Where
an MTP head drafts (:attr:`Engine.mtp`), the last decoder layer's output at every row is
handed to it (:mod:`plimsoll.engine.mtp_head`). A quantized
pool's chunk that samples attends its last token to the quantized blocks as mlx-lm's own
last-token step does
(:attr:`Batch.tail`, :mod:`plimsoll.engine.quantized`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from plimsoll.core.transients import decode_fits_unpaced, decode_transient_bytes, paced
from plimsoll.engine import decode_write, mixers, sampled_rows, state, verify
from plimsoll.engine.attention import Batch, Pacer
from plimsoll.engine.groups import Flat, Group, group_view
from plimsoll.engine.paged import RecurrentState, read_of, slots_of, write_of
from plimsoll.engine.sampling import sample
from plimsoll.engine.work import Step, Work


def groups_of(eng, step: Step) -> list[Group]:
    """The step's groups, pools grown to every block they read or write. Where every layer
    is a plain full-attention pool (:func:`verifies_as_rows`), the verifying works join the
    decode rows (:func:`rows_of_works`); elsewhere each is a chunk of its own."""
    groups, top, lo = [], 0, 0
    chunks, rowed = step.prefills, step.decodes
    if any(w.draft for w in chunks) and verifies_as_rows(eng):
        rowed = step.decodes + tuple(w for w in chunks if w.draft)
        chunks = tuple(w for w in chunks if not w.draft)
    if rowed:
        g, top = _decode_group(eng, rowed)
        groups.append(g)
        lo = g.hi
    for w in chunks:
        g = _chunk_group(eng, w, lo)
        groups.append(g)
        lo = g.hi
        top = max(top, max(w.block_table[:(w.start + w.length - 1) // eng.block_tokens + 1]))
    for p in eng._pools:
        p.ensure(top)
    if eng.decode_writes and len(groups) == 1 and groups[0].decode:
        # decode rows alone: nothing else writes the pools this step
        groups[0].batch.writes_in_read = decode_write.new_positions(groups[0])
    _pace(eng, groups)
    return groups


def _pace(eng, groups: list[Group]) -> None:
    """A heavy step (core/transients.paced) keeps at most ``eng.prefill_window`` layers in
    flight (attention.Pacer; 0: unpaced), unless it is decode rows only whose whole forward
    in flight fits ``eng.transient_budget`` (core/transients.decode_fits_unpaced). One
    group's attention is enough to pace it: in one forward every group's layer ``l`` needs
    layer ``l - 1`` of all of them."""
    if eng.prefill_window <= 0:
        return
    chunks = [g.works[0] for g in groups if not g.decode]
    gathered = sum(w.start + w.length for w in chunks if w.start)  # copied (or padded) a layer
    rows = [w for g in groups if g.decode for w in g.rows]
    if eng.decode_gathers:
        gathered += sum(w.start + 1 for w in rows)
    if not paced(sum(w.length for w in chunks), gathered):
        return
    if not chunks and rows and decode_fits_unpaced(
            decode_transient_bytes(eng.facts, len(rows), max(w.start + 1 for w in rows),
                                   eng.block_tokens, gathered=eng.decode_gathers),
            eng.facts.num_layers, eng.transient_budget):
        return  # the whole forward in flight stays within the transient admission reserved
    groups[-1].batch.pace = Pacer(eng.prefill_window)


def verifies_as_rows(eng) -> bool:
    """Whether a verifying Work's tokens run as decode rows here: every cache layer a plain
    full-attention pool, which attends one row exactly as a chunk's causal row (a latent,
    window or quantized layer attends a chunk otherwise; speculation refuses the latter
    two)."""
    return all(k.plain_kv for k in eng.flat_kinds)


def rows_of_works(works: tuple[Work, ...]) -> tuple[Work, ...]:
    """The decode rows of ``works``: a plain decode is one row; a verifying Work (``draft``
    = k) is k + 1 rows, token ``i`` at ``start + i``, each sampled. Row ``i`` reads its
    table to ``start + i + 1`` with the step's own writes of rows ``0 .. i`` in it (every
    row's K/V is written before any row attends), so it attends exactly as row ``i`` of
    the chunk would, and the verifying sequences of a step share the decode rows' one
    attention call (and the decode kernel) instead of one call each a layer."""
    if not any(w.draft for w in works):
        return works
    rows: list[Work] = []
    for w in works:
        if not w.draft:
            rows.append(w)
            continue
        tokens = w.tokens or (None,) * w.length  # a chained Work's are on the device
        rows += [Work(w.seq_id, None if t is None else (t,), w.start + i, w.block_table, True,
                      w.sampling) for i, t in enumerate(tokens)]
    return tuple(rows)


def _decode_group(eng, works: tuple[Work, ...]) -> tuple[Group, int]:
    """The decode rows of ``works`` (verifying ones included: :func:`rows_of_works`)."""
    bt = eng.block_tokens
    rows = rows_of_works(works)
    starts = [w.start for w in rows]
    lengths = [s + 1 for s in starts]
    ids = tuple(w.seq_id for w in rows)
    # The tables' index is kept across steps (only new blocks are written into it); its
    # highest id covers every block the decodes read or write.
    read, top = eng._reads.read(ids, [w.block_table for w in rows], lengths,
                                slice_ok=eng.kernels.decode is None
                                and not eng.quantized_kernel)
    inputs = None
    if any(w.chained for w in works):  # positions, slots and tokens on the device
        inputs, positions = _chained_rows(eng, works, rows)
        write = mx.take_along_axis(read.index, (positions // bt)[:, None], axis=1)[:, 0] \
            * bt + positions % bt
        lengths_mx, offset = positions + 1, positions
    else:
        lengths_mx = mx.array(lengths, dtype=mx.int32)
        offset = starts[0] if len(rows) == 1 else mx.array(starts, dtype=mx.int32)
        write = write_of(np.array([w.block_table[s // bt] * bt + s % bt
                                   for w, s in zip(rows, starts, strict=True)], np.int32))
    mask = None
    if min(lengths) != max(lengths) or inputs is not None:  # on the device, not on the host
        mask = (mx.arange(max(lengths), dtype=mx.int32)[None, :]
                < lengths_mx[:, None])[:, None, None, :]
    batch = Batch(write, read, mask, offset, lengths=lengths_mx, kernel=eng.kernels.decode)
    if eng._batched is not None and eng._batched[0] == ids:
        stacked = [state.cache_of(e) for e in eng._batched[1]]
    else:
        held = [eng._states.get(w.seq_id) or eng._fresh_state() for w in works]
        stacked = [state.stack([r[j] for r in held]) for j in range(len(held[0]))]
    rings = eng._rings.batch(list(ids), starts, 1) if eng._rings else None
    group = Group(works, 0, True, batch, rings, stacked, rows)
    group.inputs = inputs
    return group, top


def _chained_rows(eng, works: tuple[Work, ...], rows: tuple[Work, ...]):
    """Where some of ``works`` are chained (:mod:`plimsoll.engine.chain`): every row's input
    token and position on the device (a chained Work's from its chain, the others' as the
    host named them), in the rows' order."""
    chained, hosts, order, at = [], [], [], 0
    for w in works:
        n = w.draft + 1 if w.draft else 1
        if w.chained:
            chained.append(w)
            order += [-1] * n
        else:
            order += range(len(hosts), len(hosts) + n)
            hosts += rows[at:at + n]
        at += n
    tokens, positions = eng.chains.inputs(tuple(chained))
    if not hosts:
        return tokens, positions
    at, index = len(hosts), []
    for o in order:  # the chained rows follow the host rows in the sources below
        index.append(at if o < 0 else o)
        at += o < 0
    index = mx.array(np.asarray(index, dtype=np.int32))
    tokens = mx.concatenate([decode_inputs(eng, tuple(hosts)), tokens])[index]
    positions = mx.concatenate([mx.array([r.start for r in hosts], dtype=mx.int32),
                                positions])[index]
    return tokens, positions


def _chunk_group(eng, w: Work, lo: int) -> Group:
    n, bt = w.length, eng.block_tokens
    write = write_of(slots_of(w.block_table, w.start, w.start + n, bt))
    read = None if w.start == 0 else read_of([w.block_table], [w.start + n], bt)
    tail = None
    if w.sample and eng.attends_tail:
        tail = read if read is not None else read_of([w.block_table], [w.start + n], bt)
    batch = Batch(write, read, "causal" if n > 1 else None, w.start, tail=tail)
    entries = eng._states.get(w.seq_id) or eng._fresh_state()
    rings = eng._rings.batch([w.seq_id], [w.start], n) if eng._rings else None
    return Group((w,), lo, False, batch, rings, [state.cache_of(e) for e in entries])


def decode_inputs(eng, works: tuple[Work, ...]) -> mx.array:
    """The decode rows' tokens, (rows,): given ones, or those sampled last step (lazy)."""
    if all(w.tokens is not None for w in works):
        return mx.array([w.tokens[0] for w in works], dtype=mx.uint32)
    lasts = [None if w.tokens is not None else eng._last[w.seq_id] for w in works]
    first = lasts[0]
    if first is not None and all(last is not None and last[0] is first[0]
                                 and last[1] == row for row, last in enumerate(lasts)) \
            and first[0].shape[0] == len(works):
        return first[0]
    parts = [mx.array([w.tokens[0]], dtype=mx.uint32) if last is None
             else last[0][last[1]:last[1] + 1]
             for w, last in zip(works, lasts, strict=True)]
    return mx.concatenate(parts)


def _inputs(eng, g: Group) -> mx.array:
    if g.inputs is not None:
        return g.inputs
    if g.decode:
        return decode_inputs(eng, g.rows)
    return mx.array(g.works[0].tokens, dtype=mx.uint32)


def _pick(rows: list[int], total: int):
    """The row selection of the last layer's output (None: every row is sampled)."""
    if len(rows) == total:
        return None
    if rows == list(range(rows[0], rows[0] + len(rows))):
        lo, hi = rows[0], rows[0] + len(rows)
        return lambda h: h[lo:hi]
    idx = mx.array(rows, dtype=mx.int32)
    return lambda h: h[idx]


def _call(eng, inputs: mx.array, caches: list, rows: list[int]) -> mx.array | None:
    """The model on ``inputs`` (rows on axis 0 or, for one chunk, positions on axis 1); the
    logits (sampled, vocab) of ``rows`` (indices on the flattened rows), or None."""
    total = inputs.shape[0] * inputs.shape[1]
    if not rows:
        eng.model(inputs, cache=caches)  # no logits evaluated: the lm head never runs
        return None
    chunk = inputs.shape[0] == 1 and inputs.shape[1] > 1
    flat_pick = _pick(rows, total)
    if chunk:  # (1, n): the rows are positions
        pick = None if flat_pick is None else (lambda h: flat_pick(h.swapaxes(0, 1)))
    else:
        pick = flat_pick
    if eng.select_rows:
        with sampled_rows.selecting(eng.model, pick):
            logits = eng.model(inputs, cache=caches)
        return logits.reshape(len(rows), -1)
    logits = eng.model(inputs, cache=caches)
    logits = logits.reshape(total, -1)
    return logits if flat_pick is None else flat_pick(logits)


def _check(eng, groups: list[Group]) -> None:
    want = len(eng._pools) + len(eng._rings.layers)
    if any(g.batch.attended != want for g in groups):
        raise RuntimeError(f"{type(eng.model).__module__}: attention does not go through "
                           "mlx_lm.models.base.scaled_dot_product_attention; the paged "
                           "engine cannot serve this model")


def _arrays(eng, groups: list[Group]) -> list:
    pools = [a for p in eng._pools for a in (p.keys, p.values)] + eng._rings.arrays()
    return pools + [a for g in groups for c in g.states for a in c.cache if a is not None]


#: a step's sampled works and their tokens (lazy), and its verifying works with their rows'
#: checks (lazy, :func:`plimsoll.engine.verify.check`)
Out = tuple[tuple[Work, ...], mx.array | None, tuple[tuple[Work, ...], mx.array] | None]


def run(eng, groups: list[Group]) -> Out | None:
    """Run ``groups`` as one forward (see the module docstring) and queue it; None when
    nothing samples."""
    works = tuple(w for g in groups for w in g.works if w.sample)
    kept = [] if getattr(eng, "mtp", None) is not None else None
    with sampled_rows.capturing(eng.model, kept):
        logits = _forward(eng, groups)
    if kept:
        _hand_over(eng.mtp, groups, kept)
    _check(eng, groups)
    _keep_states(eng, groups)
    verified, chained = None, []
    if any(w.draft for w in works):
        logits, works, verifying, rows = _split_verified(logits, works)
        drafts = eng.chains.drafts(verifying)
        checks = verify.check(rows, verifying, eng._keys, drafts)
        verified = (verifying, checks, drafts)
        if eng.chains.held or any(w.lookup for w in verifying):
            chained = eng.chains.advance(verifying, checks, drafts)
    for w in works if eng.chains.held else ():  # a plain step ends a chain
        eng.chains.drop(w.seq_id)
    tokens = sample(logits, works, eng._keys) if works else None
    for row, w in enumerate(works):
        eng._last[w.seq_id] = (tokens, row)
    for w in verified[0] if verified else ():  # its next step names its tokens (never pipelined)
        eng._last.pop(w.seq_id, None)
    mx.async_eval(_arrays(eng, groups) + ([] if tokens is None else [tokens])
                  + ([verified[1], verified[2]] if verified else []) + chained)
    return (works, tokens, verified) if works or verified else None


def _hand_over(head, groups: list[Group], kept: list) -> None:
    """The last decoder layer's outputs (one per model call, the groups' rows in order)
    handed to the MTP head, each Work's rows at its positions."""
    if not all(isinstance(h, mx.array) for h in kept):
        return
    flat = mx.concatenate([h.reshape(-1, h.shape[-1]) for h in kept])
    at = 0
    for g in groups:
        for w in g.works:
            head.take(w.seq_id, w.start, flat[at:at + w.length])
            at += w.length


def _forward(eng, groups: list[Group]) -> mx.array | None:
    """The model's call(s) over ``groups``: the logits of the rows that sample, or None."""
    if len(groups) == 1 or not eng.mixers.ok:
        parts = []
        for g in groups:
            inputs = _inputs(eng, g)
            inputs = inputs[:, None] if g.decode else inputs[None]
            caches = [group_view(k, g, eng._state_index) for k in eng.layers]
            logits = _call(eng, inputs, caches, [r - g.lo for r in g.sampled()])
            if logits is not None:
                parts.append(logits)
            if len(groups) > 1:  # forwards writing one pool are submitted in order
                mx.async_eval(_arrays(eng, [g]))
        logits = (parts[0] if len(parts) == 1 else mx.concatenate(parts)) if parts else None
    else:
        flat = Flat(groups, eng._state_index)
        inputs = mx.concatenate([_inputs(eng, g) for g in groups])[:, None]
        caches = [mixers.step_view(k, flat) for k in eng.layers]
        logits = _call(eng, inputs, caches, [r for g in groups for r in g.sampled()])
    return logits


def _split_verified(logits: mx.array, works: tuple[Work, ...]):
    """The rows of the plain sampled works and those works; the speculating works
    (``draft + 1`` rows each, in order) and their rows."""
    plain_rows, plain, verify_rows, verifying, row = [], [], [], [], 0
    for w in works:
        if w.draft:
            verify_rows.extend(range(row, row + w.draft + 1))
            verifying.append(w)
            row += w.draft + 1
        else:
            plain_rows.append(row)
            plain.append(w)
            row += 1
    return (_rows(logits, plain_rows), tuple(plain), tuple(verifying),
            _rows(logits, verify_rows))


def _rows(logits: mx.array, rows: list[int]) -> mx.array:
    if not rows:
        return logits[:0]
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0]:rows[0] + len(rows)]
    return logits[mx.array(rows, dtype=mx.int32)]


def _keep_states(eng, groups: list[Group]) -> None:
    hybrid = any(isinstance(k, RecurrentState) for k in eng.flat_kinds)
    for g in groups:
        if g.decode:
            for j, c in enumerate(g.states):
                for w, entries in zip(g.works, state.split(c, len(g.works)), strict=True):
                    eng._states.setdefault(w.seq_id, eng._fresh_state())[j] = entries
            ids = tuple(w.seq_id for w in g.works)
            eng._batched = (ids, [list(c.cache) for c in g.states]) if g.states else None
        elif hybrid:
            w = g.works[0]
            eng._states[w.seq_id] = [c.cache for c in g.states]
            eng._touched(w.seq_id)
