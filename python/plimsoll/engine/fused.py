"""Sibling projections of one input as one product in a single-row step (imports mlx).

Why: a one-row decode step is host-bound on a GPU — every graph node is Python's building and
the backend's encoding, while the device waits (bench/results/overhead-h100-2026-12-05-split.md:
~6 ms of host work a step against ~2 ms of the weights' bytes). An attention layer's
``q_proj``, ``k_proj`` and ``v_proj`` (and an MLP's ``gate_proj`` and ``up_proj``) multiply the
same input by three (two) weights: three products where one would do.

What it does: :func:`fuse` concatenates each such group's weights into one array ``W`` (rows:
the members' in order) and gives every member a view of its rows of ``W`` as its ``weight``
(no bytes of their own: the model holds the same bytes as before, once) and a subclass of its
own type (:class:`Fused`). Called with one row (``x.size == in_features``), a member
computes ``x @ W.T`` once for the group — kept for its siblings while they are called with
the very same input array (identity, not equality), dropped once each took its part — and
returns its columns: one ``Matmul`` and one ``Split`` (views, one node for the group).
Called with more rows it is the member it was (held view, the few-row kernel,
``nn.Linear``), so a chunk or a batch of rows runs exactly as before, with no copies of
strided parts.

Plain layers (:func:`plimsoll.engine.linear.plain` types and the few-row kernel's subclass)
of one dtype and input width are fused, and quantized ones (``nn.QuantizedLinear``) of one
format — their packed weights, scales and biases each concatenated, one
``quantized_matmul`` for the row; none with a bias, none shared between groups, none over
:data:`MOST_BYTES` (the load-time copy). The product
is the same sum per output as the separate ones; a backend may order it differently for
another width (tokens equal to mlx-lm's are tested on the CPU).
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn

from plimsoll.engine.linear import HeldLinear, _views, modules, product

#: the members of a group, by attribute name, in order
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_GROUP = "_plimsoll_fused"  # the instance attribute (not a parameter) holding the group
#: a quantized member's arrays, all cut along their rows (the output features)
_QUANTIZED = ("weight", "scales", "biases")
#: the largest group fused: its arrays are held twice while concatenated at load, before
#: the pool or any step's activations exist (inside the compute reserve admission keeps)
MOST_BYTES = 256 << 20


class Siblings:
    """One group's members (not a step's group: engine/groups.py), their concatenated arrays
    and the views of them, and the last single-row product."""

    __slots__ = ("arrays", "bounds", "cuts", "left", "members", "names", "outs", "quantized",
                 "t", "t3", "views", "x")

    def __init__(self, members: list):
        self.members = members
        self.quantized = isinstance(members[0], nn.QuantizedLinear)
        self.names = [n for n in _QUANTIZED if n in members[0]] if self.quantized else ["weight"]
        widths = [m["weight"].shape[0] for m in members]
        self.bounds = list(itertools.pairwise(itertools.accumulate(widths, initial=0)))
        self.cuts = [b for _, b in self.bounds[:-1]]
        self.x: mx.array | None = None
        self.outs: list[mx.array] = []
        self.left = 0
        self.bind()

    def bind(self) -> None:
        """Concatenate the members' arrays and give each member the views of its rows (and a
        held member its held views of them), all evaluated: the old arrays go."""
        self.arrays = [mx.concatenate([m[n] for m in self.members], axis=0) for n in self.names]
        mx.eval(self.arrays)
        self.t = self.arrays[0].T
        self.t3 = self.t[None]
        made = [self.t, self.t3]
        for m, (a, b) in zip(self.members, self.bounds, strict=True):
            for n, whole in zip(self.names, self.arrays, strict=True):
                m[n] = whole[a:b]
                made.append(m[n])
            if isinstance(m, HeldLinear):
                made += _views(m, m["weight"])[1:]
        mx.eval(made)
        self.views = [[m[n] for n in self.names] for m in self.members]

    def bound(self) -> bool:
        """Whether every member's arrays are still the views :meth:`bind` gave it (not when
        the model's weights were replaced since, nor inside ``mx.compile``'s trace, whose
        weights are its inputs)."""
        return all(m[n] is v for m, vs in zip(self.members, self.views, strict=True)
                   for n, v in zip(self.names, vs, strict=True))

    def _product(self, x: mx.array) -> mx.array:
        if not self.quantized:
            return product(x, self.t, self.t3)
        m = self.members[0]
        scales, biases = self.arrays[1], (self.arrays[2] if len(self.arrays) > 2 else None)
        return mx.quantized_matmul(x, self.arrays[0], scales=scales, biases=biases,
                                   transpose=True, group_size=m.group_size, bits=m.bits,
                                   mode=getattr(m, "mode", "affine"))

    def part(self, index: int, x: mx.array) -> mx.array | None:
        """Member ``index``'s output for the single row ``x``; None where the group is not
        :meth:`bound` (the member then computes its own)."""
        if self.x is not x:
            if not self.bound():
                return None
            y = self._product(x)
            # one Split (a multi-output view) rather than a Slice a member
            self.x, self.outs, self.left = x, mx.split(y, self.cuts, axis=-1), 0
        out = self.outs[index]
        self.left |= 1 << index
        if self.left == (1 << len(self.bounds)) - 1:  # every member took its part
            self.x, self.outs = None, []
        return out


class Fused:
    """A group member (mixed in before its own type): one row through the group's one
    product, more rows as its own type computes them."""

    def __call__(self, x: mx.array) -> mx.array:
        group, index = self.__dict__[_GROUP]
        if x.size == x.shape[-1] and (out := group.part(index, x)) is not None:
            return out
        return super().__call__(x)


_SUBCLASSES: dict[type, type] = {}


def _fused_type(base: type) -> type:
    """``base``'s fused subclass (made once per base: the held, few-row or quantized type)."""
    if base not in _SUBCLASSES:
        _SUBCLASSES[base] = type(f"Fused{base.__name__}", (Fused, base), {})
    return _SUBCLASSES[base]


def _fusable(members: list) -> bool:
    """Plain (held) layers of one dtype and input width, or quantized ones of one format;
    none with a bias, none fused already."""
    if not all(isinstance(m, nn.Module) for m in members):
        return False
    if any(isinstance(m, Fused) or "bias" in m for m in members):
        return False
    ws = [m["weight"] for m in members]
    if len({(w.dtype, w.shape[1], w.ndim) for w in ws}) != 1 or ws[0].ndim != 2:
        return False
    if sum(m[n].nbytes for m in members for n in _QUANTIZED if n in m) > MOST_BYTES:
        return False
    if all(isinstance(m, HeldLinear) for m in members):
        return True
    return (all(type(m) is nn.QuantizedLinear for m in members)
            and len({(m.group_size, m.bits, getattr(m, "mode", None),
                      tuple(n for n in _QUANTIZED if n in m)) for m in members}) == 1)


def fuse(model) -> int:
    """Fuse every group of :data:`GROUPS` in ``model`` that qualifies (see the module
    docstring), the weights evaluated and the old arrays let go; how many groups."""
    seen: set[int] = set()
    fused = 0
    for parent in modules(model):
        for names in GROUPS:
            members = [parent.get(n) if isinstance(parent, dict) else None for n in names]
            if any(m is None for m in members) or any(id(m) in seen for m in members):
                continue
            if not _fusable(members):
                continue
            group = Siblings(members)
            for i, m in enumerate(members):
                m.__class__ = _fused_type(type(m))
                m.__dict__[_GROUP] = (group, i)
                seen.add(id(m))
            fused += 1
    return fused


def rebind(model) -> int:
    """Fuse again every group whose weights were replaced (``model.update``); how many."""
    groups = {id(g): g for m in modules(model) if isinstance(m, Fused)
              for g in [m.__dict__[_GROUP][0]] if not g.bound()}
    for g in groups.values():
        g.bind()
    return len(groups)


def unfuse(model) -> int:
    """Put back every fused member's own type (its weight stays the view: the same values);
    how many members. A benchmark's A/B."""
    back = 0
    for m in modules(model):
        if isinstance(m, Fused):
            m.__class__ = type(m).__mro__[2]  # (Fused<base>, Fused, base, ...)
            m.__dict__.pop(_GROUP, None)
            back += 1
    return back


def fused_members(model) -> int:
    """How many of ``model``'s layers are group members now."""
    return sum(isinstance(m, Fused) for m in modules(model))
