"""One forward per step: the model's token-mixing modules run per group inside it (imports mlx).

**Layout.** Every token a step schedules — each decode row's one token, each prefill chunk's
tokens at any start — enters the model as ONE ``(T, 1)`` batch: each token a row of length
one, the decode rows first, then each chunk's tokens in order. What is token-wise (the
embedding, norms, MLPs and MoE, residuals, the lm head) runs once for all ``T`` rows. Only
the modules that mix tokens — attention, MLA attention, a recurrent mixer (gated delta,
mamba, short conv): the modules that receive a cache — are *regrouped*: their class's
``__call__`` is wrapped so that, handed a :class:`StepView`, it runs once per group (the
decode rows as one ``(rows, 1)`` batch, each chunk as ``(1, n)``) with that group's own cache
view — exactly the call mlx-lm's model makes for a decode batch or for one prompt chunk — and
the outputs go back to their rows. Handed anything else (mlx-lm's own caches, a group's
view) the wrapper calls straight through.

**Why not B = 1, L = T.** mlx-lm's attention calls ``self.rope(x, offset=cache.offset)`` and
``mx.fast.rope`` takes one offset per batch row (MLX 0.32: "a scalar or vector of B
offsets"): only rows of length one carry a position per token through the model's own rope
call. Recurrent layers need each sequence's tokens in order along L with that sequence's
state, and MLA layers branch on ``L == 1`` (absorbed) against ``L > 1`` (expanded): per
group each sees what mlx-lm gives it. **Why not padded rows** (B = sequences, L = the
longest): 4 decodes beside a 256-token chunk would run 5 × 256 positions through every MLP.

**How modules are found** (:func:`discover`, once per model): two tiny probe forwards on
mlx-lm's own caches, a batch of 3 rows of one token and one row of 2 tokens, under
``sys.setprofile``. A cache's module is the deepest ``nn.Module.__call__`` receiving it as
an argument (a ``CacheList`` member that no module receives falls back to its layer's
cache); a module nested in another one found for the same layer is left to its parent.
Comparing the two probes' arguments gives each parameter's batch and length axes (the
first is 3 → 1, the second 1 → 2), so an argument the model computed per token outside the
module (ministral3's llama-4 query scale) is regrouped like the hidden states; a parameter
named ``*mask*`` gets the group view's own mask. A model whose modules do not fit (varargs,
an argument that changes shape in another way) is reported (:attr:`Mixers.reason`) and
the engine runs one forward per group instead.

Logits only where sampled: :mod:`plimsoll.engine.sampled_rows`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from plimsoll.engine import attention, composite

_WRAPPED: dict[type, dict] = {}  # class -> {param name: spec}, "__out__": output spec
_ORIGINAL: dict[type, Callable] = {}
_B, _L = 3, 2  # the probes: (_B, 1) and (1, _L)


class Unsupported(Exception):
    """The model's token-mixing modules cannot be regrouped (the reason is the message)."""


class StepView:
    """One cache (a layer's, or a ``CacheList`` member's) in the ``(T, 1)`` forward.

    Code outside the token-mixing modules sees a decode batch of ``T`` rows: per-token
    positions as ``offset``, no mask. A wrapped module asks :meth:`view` for each group's
    real view. Anything that would write or read through it directly is refused: a module
    the discovery missed must not attend to nothing."""

    keys = values = None  # pipeline-parallel code chains them with mx.depends: dropped

    def __init__(self, kind, step):
        self.kind, self.step = kind, step
        self.offset = step.positions

    def view(self, group):
        return self.step.view(self.kind, group)

    def fence(self, after: mx.array) -> None:
        self.step.fence(self.kind, after)

    def make_mask(self, *args, **kwargs):
        return None

    def update_and_fetch(self, *args):
        raise RuntimeError("a token-mixing module of this model was not regrouped (its cache "
                           "reached it unsplit); the engine cannot serve it in one forward")

    def __getitem__(self, idx):
        raise RuntimeError("a recurrent-state cache was read outside its mixer module")

    @property
    def state(self):
        return []

    nbytes = 0

    def empty(self) -> bool:
        return False

    def is_trimmable(self) -> bool:
        return False


class CompositeStepView(StepView):
    """A ``CacheList`` layer in the ``(T, 1)`` forward: the model indexes its members."""

    def __init__(self, kind, step):
        super().__init__(kind, step)
        self.members = [step_view(p, step) for p in kind.parts]

    def __getitem__(self, idx):
        return self.members[idx]

    def fence(self, after: mx.array) -> None:
        for m in self.members:
            m.fence(after)


def step_view(kind, step) -> StepView:
    if isinstance(kind, composite.Composite):
        return CompositeStepView(kind, step)
    return StepView(kind, step)


# ------------------------------------------------------------------ discovery


class _Call:
    __slots__ = ("args", "depth", "frame", "module", "out", "parent")

    def __init__(self, module, parent, frame, args):
        self.module, self.parent, self.frame, self.args = module, parent, frame, args
        self.depth = 0 if parent is None else parent.depth + 1
        self.out = None

    def within(self, other: _Call) -> bool:
        p = self.parent
        while p is not None:
            if p is other:
                return True
            p = p.parent
        return False


def _caches(model, rows: int) -> list:
    """mlx-lm's batch caches for ``rows`` rows (an offset array per layer, as a
    :class:`StepView` has); its plain caches where the model has no batch form."""
    per_row = [make_prompt_cache(model) for _ in range(rows)]
    try:
        return [type(c).merge([r[i] for r in per_row]) for i, c in enumerate(per_row[0])]
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return per_row[0]


def _record(model, inputs: mx.array) -> tuple[list[_Call], list]:
    """Every ``nn.Module.__call__`` of one forward on mlx-lm's caches: arguments, output."""
    caches = _caches(model, inputs.shape[0])
    calls: list[_Call] = []
    stack: list[_Call] = []

    def profile(frame, event, arg):
        if frame.f_code.co_name != "__call__":
            return
        if event == "call":
            me = frame.f_locals.get("self")
            if isinstance(me, nn.Module):
                c = _Call(me, stack[-1] if stack else None, frame, dict(frame.f_locals))
                calls.append(c)
                stack.append(c)
        elif event == "return" and stack and stack[-1].frame is frame:
            stack[-1].out, stack[-1].frame = arg, None
            stack.pop()

    sys.setprofile(profile)
    try:
        mx.eval(model(inputs, cache=caches))
    finally:
        sys.setprofile(None)
    return calls, caches


def _receiver(calls: list[_Call], obj) -> _Call | None:
    """The deepest call receiving ``obj`` as an argument (their common ancestor if several
    calls on different branches receive it)."""
    got = [c for c in calls if any(v is obj for v in c.args.values())]
    if not got:
        return None
    deepest = max(got, key=lambda c: c.depth)
    if all(c is deepest or deepest.within(c) for c in got):
        return deepest
    common = deepest.parent
    while common is not None and not all(c is common or c.within(common) for c in got):
        common = common.parent
    return common


def _axes(a, b) -> tuple[int, int] | None:
    """(batch axis, length axis) of an array whose shape is ``a`` in the (3, 1) probe and
    ``b`` in the (1, 2) one; None when the shapes are equal (not per token)."""
    if a == b:
        return None
    if len(a) != len(b):
        raise Unsupported(f"an argument of rank {len(a)} became rank {len(b)}")
    batch = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if (x, y) == (_B, 1)]
    length = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if (x, y) == (1, _L)]
    rest = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if len(batch) != 1 or len(length) != 1 or len(rest) != 2:
        raise Unsupported(f"an argument shaped {a} for 3 rows of one token is {b} for one "
                          "row of two: not one batch and one length axis")
    return batch[0], length[0]


def _spec(value_a, value_b):
    """How one argument (or output) is regrouped: ("tokens", batch, length), ("tuple", ...),
    or None (passed as it is)."""
    if isinstance(value_a, mx.array) and isinstance(value_b, mx.array):
        axes = _axes(tuple(value_a.shape), tuple(value_b.shape))
        return None if axes is None else ("tokens", *axes)
    if isinstance(value_a, tuple | list) and isinstance(value_b, tuple | list) \
            and len(value_a) == len(value_b):
        inner = tuple(_spec(x, y) for x, y in zip(value_a, value_b, strict=True))
        return None if all(s is None for s in inner) else ("tuple", *inner)
    if isinstance(value_a, mx.array) or isinstance(value_b, mx.array):
        raise Unsupported(f"an argument is {type(value_a).__name__} for 3 rows of one token "
                          f"and {type(value_b).__name__} for one row of two")
    return None


class Mixers:
    """The token-mixing module classes of one model, wrapped (or why they could not be)."""

    def __init__(self, classes: tuple[type, ...], reason: str = ""):
        self.classes, self.reason = classes, reason

    @property
    def ok(self) -> bool:
        return not self.reason

    def report(self) -> dict:
        """For the worker's status: the modules regrouped, or why a step runs one forward
        per group."""
        return {"regrouped": [f"{c.__module__}.{c.__name__}" for c in self.classes],
                "reason": self.reason}


def discover(model) -> Mixers:
    """Find and wrap the token-mixing modules of ``model`` (see the module docstring)."""
    try:
        calls_a, caches_a = _record(model, mx.zeros((_B, 1), dtype=mx.uint32))
        calls_b, _ = _record(model, mx.zeros((1, _L), dtype=mx.uint32))
        chosen: list[_Call] = []
        for entry in caches_a:
            layer: list[_Call] = []
            for member in composite.members(entry):
                got = _receiver(calls_a, member) or _receiver(calls_a, entry)
                if got is None:
                    raise Unsupported(f"no module receives the cache {type(member).__name__}")
                if got not in layer:
                    layer.append(got)
            chosen += [c for c in layer if not any(c.within(o) for o in layer if o is not c)]
        firsts_b: dict[int, _Call] = {}
        for c in calls_b:
            firsts_b.setdefault(id(c.module), c)
        specs: dict[type, dict] = {}
        for c in chosen:
            cls = type(c.module)
            code = _ORIGINAL.get(cls, cls.__call__).__code__
            if code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS):
                raise Unsupported(f"{cls.__name__}.__call__ takes *args/**kwargs")
            b = firsts_b.get(id(c.module))
            if b is None:
                raise Unsupported(f"{cls.__name__} is not called for one row of two tokens")
            spec = {name: ("mask",) if "mask" in name else _spec(value, b.args.get(name))
                    for name, value in c.args.items() if name != "self"
                    and not _is_cache(value)}
            spec["__out__"] = _spec(c.out, b.out)
            if specs.setdefault(cls, spec) != spec:
                raise Unsupported(f"{cls.__name__}'s arguments differ between its layers")
    except Unsupported as e:
        return Mixers((), f"{type(model).__module__}: {e}")
    for cls, spec in specs.items():
        _wrap(cls, spec)
    return Mixers(tuple(specs))


def _is_cache(value) -> bool:
    return hasattr(value, "update_and_fetch") or hasattr(value, "make_mask") \
        or type(value).__name__ in ("CacheList", "ArraysCache")


# ------------------------------------------------------------------ the regrouping wrapper


def _wrap(cls: type, spec: dict) -> None:
    if cls in _ORIGINAL:
        _WRAPPED[cls] = spec
        return
    original = cls.__call__
    signature = inspect.signature(original)
    _ORIGINAL[cls], _WRAPPED[cls] = original, spec

    def regrouped(self, *args, **kwargs):
        view = next((v for v in (*args, *kwargs.values()) if isinstance(v, StepView)), None)
        if view is None:
            return original(self, *args, **kwargs)
        return _per_group(original, signature, _WRAPPED[cls], view, self, args, kwargs)

    regrouped.__wrapped__ = original
    cls.__call__ = regrouped


def _per_group(original, signature, spec, view: StepView, module, args, kwargs):
    bound = signature.bind(module, *args, **kwargs)
    given = dict(bound.arguments)
    groups = view.step.groups
    gviews = [view.view(g) for g in groups]
    if write_once(view, gviews):
        parts = []
        for group, gview in zip(groups, gviews, strict=True):
            gview.capturing = True
            try:
                original(**_arguments(given, spec, view, group, gview))
            except attention.Captured:
                pass
            finally:
                gview.capturing = False
            if gview.written is None:
                raise RuntimeError(f"{type(module).__name__} returned without writing its "
                                   "keys and values; the engine cannot serve it in one forward")
            parts.append((gview.batch.write, *gview.written))
        view.kind.write_all(parts)
        outs = [original(**_arguments(given, spec, view, g, gv))
                for g, gv in zip(groups, gviews, strict=True)]
        return _join(outs, groups, spec["__out__"])
    outs = []
    for i, (group, gview) in enumerate(zip(groups, gviews, strict=True)):
        if i:  # the next group's pool writes wait for this group's reads (in place)
            view.fence(_first_array(outs[-1]))
        outs.append(original(**_arguments(given, spec, view, group, gview)))
    return _join(outs, groups, spec["__out__"])


def write_once(view: StepView, gviews: list) -> bool:
    """Whether a layer's groups write its pool in one scatter before any of them reads
    (:class:`~plimsoll.engine.attention.PagedView`): a plain full-attention pool written by
    several groups. Their module is then built twice per group on the host (the first
    call only up to its K/V; what it computed past them is never evaluated)."""
    return (len(gviews) > 1 and view.kind.plain_kv
            and all(type(g) is attention.PagedView for g in gviews))


def _arguments(given: dict, spec: dict, view: StepView, group, gview) -> dict:
    call = {}
    for name, value in given.items():
        kind = spec.get(name)
        if isinstance(value, StepView):
            call[name] = gview if value is view else value.view(group)
        elif kind is not None and kind[0] == "mask":
            call[name] = gview.make_mask(group.length) if hasattr(gview, "make_mask") \
                else None
        else:
            call[name] = _take(group, value, kind)
    return call


def _take(group, value, spec):
    if spec is None:
        return value
    if spec[0] == "tuple":
        return type(value)(_take(group, v, s) for v, s in zip(value, spec[1:], strict=True))
    return group.take(value, spec[1], spec[2])


def _first_array(out) -> mx.array:
    return out if isinstance(out, mx.array) else next(o for o in out if isinstance(o, mx.array))


def _join(outs: list, groups, spec):
    if spec is None:
        return outs[-1]
    if spec[0] == "tuple":
        return type(outs[0])(_join([o[i] for o in outs], groups, s)
                             for i, s in enumerate(spec[1:]))
    parts = [g.give(o, spec[1], spec[2]) for g, o in zip(groups, outs, strict=True)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=spec[1])
