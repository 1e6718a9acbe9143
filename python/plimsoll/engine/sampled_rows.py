"""Logits only at the rows that sample: the last decoder layer's output cut (imports mlx).

The last decoder layer's class (``model.layers[-1]``) is wrapped once per class: during a
step (:func:`selecting`) that layer's output keeps only the rows that sample — each decode
row, each chunk's last token that samples — so the final norm and the lm head run on those
rows alone (vLLM's ``logits_indices``); outside a step the wrapper calls straight through.
While :func:`capturing`, the wrapper also keeps the layer's full output (the hidden states
an MTP head drafts from).
:func:`rows_selectable` checks at load, on mlx-lm's own caches, that the model's logits of
the selected rows equal its full logits' rows; a model where they do not gets its logits
for every row and the rows taken after (:mod:`plimsoll.engine.forward`).

The last layer itself still runs on every row (its K/V are written for all of them): for
a chunk's rows that do not sample its attention and MLP are computed and dropped — 1 /
layers of the chunk's compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

_SELECT: dict[int, Callable] = {}  # id(last decoder layer) -> row selection, during a step
_CAPTURE: dict[int, list] = {}  # id(last decoder layer) -> its full outputs, while capturing


def _last_layer(model):
    layers = getattr(model, "layers", None)
    return layers[-1] if layers else None


def _wrap_select(cls: type) -> None:
    if getattr(cls.__call__, "_plimsoll_select", False):
        return
    original = cls.__call__

    def selected(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if (kept := _CAPTURE.get(id(self))) is not None:
            kept.append(out)
        pick = _SELECT.get(id(self))
        return out if pick is None else pick(out)

    selected._plimsoll_select = True
    selected.__wrapped__ = original
    cls.__call__ = selected


@contextlib.contextmanager
def selecting(model, pick: Callable | None):
    """During the block, the last decoder layer's output is ``pick(output)`` (None: all)."""
    last = _last_layer(model)
    if pick is None or last is None:
        yield
        return
    _SELECT[id(last)] = pick
    try:
        yield
    finally:
        _SELECT.pop(id(last), None)


@contextlib.contextmanager
def capturing(model, into: list | None):
    """During the block, every output of the last decoder layer, before any row is cut, is
    appended to ``into`` (None: nothing is kept); what an MTP head reads."""
    last = _last_layer(model)
    if into is None or last is None:
        yield
        return
    _wrap_select(type(last))
    _CAPTURE[id(last)] = into
    try:
        yield
    finally:
        _CAPTURE.pop(id(last), None)


def rows_selectable(model) -> bool:
    """Wrap the last decoder layer and check, on mlx-lm's own caches, that selecting rows of
    its output gives the model's logits of those rows."""
    last = _last_layer(model)
    if last is None:
        return False
    _wrap_select(type(last))
    inputs = mx.array([[1], [2], [3]], dtype=mx.uint32)
    try:
        full = model(inputs, cache=make_prompt_cache(model))
        with selecting(model, lambda h: h[2:3]):
            some = model(inputs, cache=make_prompt_cache(model))
        if not isinstance(some, mx.array) or some.shape[0] != 1:
            return False
        # a wrong selection gives another row's logits; a right one differs by rounding,
        # which in half precision (bf16: 8 bits of mantissa) passes 1e-3 on a GPU's matmul
        # of another row count
        tol = 1e-3 if full.dtype == mx.float32 else 3e-2
        want = full[2].astype(mx.float32)
        scale = max(1.0, float(mx.abs(want).max().item()))
        return bool(mx.allclose(some[0].astype(mx.float32), want, rtol=tol,
                                atol=tol * scale).item())
    except (TypeError, ValueError, IndexError):  # the layer's output is not one array
        return False
