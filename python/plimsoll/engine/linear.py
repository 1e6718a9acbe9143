"""A model's linear layers reading their weight through a transposed view they keep (imports mlx).

Why: mlx's ``nn.Linear`` computes ``x @ weight.T`` at every call, and mlx's ``matmul`` folds a
3-D input's batch into rows around a 2-D weight. So each projection of a step is four graph
nodes — ``Transpose``, ``Flatten``, ``Matmul``, ``Unflatten`` — where the product is one, and a
GPU backend encodes every node at the step's submission: on the H200 a one-row decode step of
the Qwen3-4B-shaped model was 2,027 nodes, 759 of them these views (253 projections), at ~2 µs
each of encoding on top of Python's 2.5 ms (bench/results/verify-host-h200-2026-12-05.md). A
single stream there is host-bound (6.5 ms of host work a step against ~2 ms for its weights'
bytes).

What it does: :func:`hold` gives every plain ``nn.Linear`` and ``nn.Embedding`` of a model a
subclass (:class:`HeldLinear`, :class:`HeldEmbedding`: the embedding's ``as_linear``, a tied lm
head) that keeps ``weight.T`` and the same view with a leading axis of one (views: no bytes of
their own), and multiplies by them. A 3-D input of one batch row — a single decode row, or one
sequence's prompt chunk — against the (1, k, n) view is one ``Matmul`` node; several batch rows
are a ``Broadcast`` and a ``Matmul`` on a GPU, whose backends fold a batch that shares its
weight into the rows of one product (MLX's CUDA and Metal ``matmul``: the same kernel as the
flattened call), and on the CPU, whose backend would multiply batch by batch, the flattened
call against the kept view (no ``Transpose``). A replaced weight (another array under
``weight``) is seen by identity at the next call and its views made again; inside
``mx.compile``'s trace the weight is the trace's input, so a compiled step reads the weight it
is given.

Measured on the H200 (``bench/verify_host.py --ab``, in process, interleaved;
bench/results/verify-host-h200-2026-12-05-held.md): a one-row decode step 1,268 nodes, against
1,703 with 145 of its projections plain (the 108 the few-row kernel had taken,
:mod:`.skinny_cuda`, stayed held in that run) and 2,027 with all plain before;
``mx.async_eval``'s encoding 6.42 → 5.58 ms of CPU, Python's building 4.38 → 3.97 ms (medians
of three rounds) for those 145. The same products in the same kernels: outputs are equal to
``nn.Linear``'s bit for bit (tested on the CPU for every input shape). Quantized layers are not
touched: their ``quantized_matmul`` takes the weight as it is stored and a 3-D input as it
comes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from plimsoll.engine import backend

_HELD = "_plimsoll_held"  # the instance attribute (not a parameter) holding the views


def _views(module: nn.Module, weight: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(weight, weight.T, weight.T[None]) kept on ``module``; made again when ``weight`` is
    another array than the one they were made of."""
    held = module.__dict__.get(_HELD)
    if held is None or held[0] is not weight:
        t = weight.T
        held = (weight, t, t[None])
        module.__dict__[_HELD] = held
    return held


def product(x: mx.array, t: mx.array, t3: mx.array) -> mx.array:
    """``x @ t`` in the fewest graph nodes (``t3`` is ``t[None]``). Several batch rows take
    ``t3`` only on a GPU: MLX's CUDA and Metal ``matmul`` fold a batch that shares its weight
    into one product's rows, its CPU one multiplies batch by batch."""
    if x.ndim == 3 and (x.shape[0] == 1 or backend.gpu()):
        return x @ t3
    return x @ t


class HeldLinear(nn.Linear):
    """An ``nn.Linear`` multiplying by a transposed view of its weight kept across calls."""

    def __call__(self, x: mx.array) -> mx.array:
        _, t, t3 = _views(self, self["weight"])
        if "bias" in self:
            return mx.addmm(self["bias"], x, t)
        return product(x, t, t3)


class HeldEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose ``as_linear`` (a tied lm head) multiplies by a kept view."""

    def as_linear(self, x: mx.array) -> mx.array:
        _, t, t3 = _views(self, self.weight)
        return product(x, t, t3)


#: each plain module type and the subclass :func:`hold` gives it
HELD = {nn.Linear: HeldLinear, nn.Embedding: HeldEmbedding}


def modules(model) -> list:
    """``model``'s modules: none for an object that is not an ``nn.Module`` (a cluster
    rank's stage wraps its layers)."""
    return [m for _, m in model.named_modules()] if isinstance(model, nn.Module) else []


def plain(module, kind: type) -> bool:
    """Whether ``module`` is a ``kind`` (``nn.Linear`` / ``nn.Embedding``) whose products are
    mlx's own math: the plain type or its held subclass, not a quantized or custom one."""
    return type(module) in (kind, HELD[kind])


def hold(model) -> int:
    """Give every plain ``nn.Linear`` and ``nn.Embedding`` of ``model`` its held subclass and
    its views, evaluated (so no step's graph makes them); how many."""
    views = []
    for module in modules(model):
        held = HELD.get(type(module))
        if held is not None:
            module.__class__ = held
            views += _views(module, module["weight"])[1:]
    mx.eval(views)
    return len(views) // 2


def release(model) -> int:
    """Put back the plain type of every held module of ``model`` (a benchmark's A/B); how
    many. The kept views are dropped."""
    back = {held: kind for kind, held in HELD.items()}
    released = 0
    for module in modules(model):
        kind = back.get(type(module))
        if kind is not None:
            module.__class__ = kind
            module.__dict__.pop(_HELD, None)
            released += 1
    return released
