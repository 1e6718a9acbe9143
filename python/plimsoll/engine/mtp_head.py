"""A checkpoint's multi-token-prediction (MTP / nextn) head as a drafter (imports mlx, mlx_lm).

GLM-4.x (``glm4_moe``), DeepSeek-V3 and others ship ``num_nextn_predict_layers`` extra
layers as ``model.layers.{num_hidden_layers + i}.*``, which mlx-lm's ``sanitize`` drops at
load. :func:`find` reads the checkpoint's index (or its files' headers) for them and
:func:`load` builds the first as :class:`Head`: ``eh_proj(concat(enorm(embed(x_{j+1})),
hnorm(h_j)))`` through one decoder layer of the model's own class (built from the model's
args, its weights through the model's own ``sanitize``), then the head's ``shared_head``
norm and lm head (the model's final norm and lm head where the checkpoint has none).
``h_j`` is the target's hidden state at position ``j`` (its last decoder layer's output
under its final norm), ``x_{j+1}`` the token sampled there; the output predicts ``x_{j+2}``.

The target hands the hidden states over from its one forward: while :attr:`Engine.hidden`
is a dict (set by :class:`~plimsoll.worker.mtp.MTPDrafter`), every step keeps each
sequence's rows of the last decoder layer's output, lazily (:mod:`.sampled_rows` captures
them before the rows that sample are cut). :meth:`Head.draft` then, per sequence:

1. catch up: the head's KV over the positions whose hidden state and next token are both
   known (contiguous from what it has seen; the latest capture of a position wins, so the
   rows of rejected drafts are overwritten before they are used);
2. draft ``k`` tokens greedily: the first from the last caught-up position; each further one
   from the head's own output at the position before (the head reused, as vLLM and SGLang do
   beyond its depth); then its KV is cut back to the caught-up positions.

KV: one :class:`Cache` per sequence (mlx-lm's ``KVCache`` at an absolute start, so a
sequence whose prompt began at a prefix hit stores only its own positions), grown a block
of tokens at a time: a sequence holds at most its own blocks' positions plus one block
(:attr:`Head.block_bytes` per block, counted at load). Drafts are proposals only: the target
verifies them, so nothing here changes the output.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from plimsoll.core.safetensors_header import tensor_bytes

#: the tensors an MTP layer must have besides its decoder layer
NEEDED = ("eh_proj.weight", "enorm.weight", "hnorm.weight")


def find(model_dir: Path) -> tuple[dict[str, Path], str]:
    """The first MTP layer's tensors (name -> file) and why there are none ("" when found)."""
    config = json.loads((model_dir / "config.json").read_text())
    depth = config.get("num_nextn_predict_layers") or 0
    if depth <= 0:
        return {}, "the checkpoint has no MTP layers (num_nextn_predict_layers is 0)"
    prefix = f"model.layers.{config['num_hidden_layers']}."
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text())["weight_map"]
        found = {k: model_dir / f for k, f in names.items() if k.startswith(prefix)}
    else:
        found = {k: path for path in sorted(model_dir.glob("model*.safetensors"))
                 for k in tensor_bytes(path) if k.startswith(prefix)}
    missing = [n for n in (*NEEDED, "self_attn") if not any(
        k.startswith(prefix + n) for k in found)]
    if missing:
        return {}, (f"num_nextn_predict_layers is {depth} but the checkpoint lacks "
                    f"{', '.join(prefix + m for m in missing)} (mlx conversions drop them)")
    return found, ""


class Cache(KVCache):
    """mlx-lm's KVCache whose first stored position is ``base``: ``offset`` (what RoPE
    reads) is absolute, the storage holds positions ``base ..``; grows ``step`` at a time."""

    def __init__(self, base: int, step: int):
        super().__init__()
        self.base, self.offset, self.step = base, base, step

    def update_and_fetch(self, keys, values):
        self.offset -= self.base
        try:
            return super().update_and_fetch(keys, values)
        finally:
            self.offset += self.base

    def keys_and_values(self):
        stored = self.offset - self.base
        return self.keys[..., :stored, :], self.values[..., :stored, :]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class Head(nn.Module):
    """The MTP layer (see the module docstring); ``model``'s embedding, final norm and lm
    head are used, never copied (held outside the module's parameters)."""

    def __init__(self, model, layer: nn.Module, own_norm: bool, own_head: bool,
                 block_tokens: int):
        super().__init__()
        args = model.args
        self.enorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.layer = layer
        if own_norm:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if own_head:
            self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._target = [model]  # a list: not a child module (its weights are not ours)
        self._block_tokens = block_tokens
        self._caches: dict[int, Cache] = {}
        #: seq id -> [(start, rows)]: the target's hidden states handed over, oldest first
        self.captured: dict[int, list[tuple[int, mx.array]]] = {}
        self.block_bytes = 0  # one block of tokens of this layer's KV (set by load)
        self._stream = mx.default_stream(mx.default_device())  # the engine's (attach)

    # --------------------------------------------------------------- the layer

    def _lm(self):
        model = self._target[0]
        return getattr(model, "model", None) or model.language_model.model

    def _logits(self, h: mx.array) -> mx.array:
        model, lm = self._target[0], self._lm()
        h = self.norm(h) if "norm" in self else lm.norm(h)
        if "head" in self:
            return self.head(h)
        head = getattr(model, "lm_head", None)
        return head(h) if head is not None else lm.embed_tokens.as_linear(h)

    def _step(self, tokens: mx.array, hidden: mx.array, cache: Cache) -> mx.array:
        """The layer over (1, n) tokens and their (1, n, D) previous hidden states."""
        x = mx.concatenate([self.enorm(self._lm().embed_tokens(tokens)),
                            self.hnorm(hidden)], axis=-1)
        n = tokens.shape[1]
        return self.layer(self.eh_proj(x), "causal" if n > 1 else None, cache)

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self._caches.values())

    # --------------------------------------------------------------- drafting

    def take(self, seq_id: int, start: int, rows: mx.array) -> None:
        """The target's last-layer output at ``start ..`` for ``seq_id`` (lazy)."""
        self.captured.setdefault(seq_id, []).append((start, rows))

    def _hidden(self, seq_id: int, lo: int, hi: int) -> tuple[int, list[mx.array]]:
        """The latest captured rows for positions ``lo ..`` as far as they are contiguous
        and below ``hi``: (the end reached, the row slices in order)."""
        caps = self.captured.get(seq_id, [])
        out, at = [], lo
        while at < hi:
            cap = next(((s, r) for s, r in reversed(caps) if s <= at < s + r.shape[0]), None)
            if cap is None:
                break
            s, r = cap
            end = min(hi, s + r.shape[0])
            out.append(r[at - s:end - s])
            at = end
        return at, out

    def _catch_up(self, seq_id: int, tokens: list[int]) -> tuple[Cache | None, mx.array | None]:
        """Write the head's KV for every position whose hidden state and next token are
        known; its cache and its output at the last such position (None: none new)."""
        caps = self.captured.get(seq_id)
        cache = self._caches.get(seq_id)
        first = min((s for s, _ in caps), default=None) if caps else None
        if first is not None and (cache is None or first > cache.offset):
            # the first capture, or a gap before every capture (the sequence was written
            # again from a later start): the head's KV starts there
            cache = self._caches[seq_id] = Cache(first, self._block_tokens)
        if cache is None:
            return None, None
        lo = cache.offset
        hi, rows = self._hidden(seq_id, lo, len(tokens) - 1)
        out = None
        if hi > lo:
            norm = self._lm().norm
            hidden = norm(mx.concatenate(rows).reshape(1, hi - lo, -1))
            out = self._step(mx.array([tokens[lo + 1:hi + 1]], dtype=mx.uint32), hidden,
                             cache)[:, -1:]
        # keep only what a later catch-up may still read: positions at or past the cache's
        self.captured[seq_id] = [(s, r) for s, r in (caps or ()) if s + r.shape[0] > hi]
        return cache, out

    def draft(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, tuple[int, ...]]:
        """Catch every sequence of ``wants`` (seq id -> (its known tokens, drafts wanted))
        up, then draft for those that want ``k`` > 0 and are caught up to their last token
        (the module docstring); their drafts, greedy."""
        with mx.stream(self._stream):
            return self._draft(wants)

    def _draft(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, tuple[int, ...]]:
        lazy: dict[int, list[mx.array]] = {}
        written: list[mx.array] = []  # every cache the catch-up wrote: evaluated now, so no
        for seq_id, (tokens, k) in wants.items():  # graph grows over steps without a draft
            cache, out = self._catch_up(seq_id, tokens)
            if out is not None:
                written += [cache.keys, cache.values]
            if k <= 0 or out is None or cache.offset != len(tokens) - 1:
                continue
            drafts = [mx.argmax(self._logits(out)[0, -1]).astype(mx.uint32)]
            for _ in range(k - 1):
                out = self._step(drafts[-1].reshape(1, 1), out, cache)
                drafts.append(mx.argmax(self._logits(out)[0, -1]).astype(mx.uint32))
            lazy[seq_id] = drafts
            cache.trim(k - 1)  # the drafted positions: rewritten with the target's states
        if not lazy:
            if written:
                mx.async_eval(written)
            return {}
        mx.eval([t for ts in lazy.values() for t in ts] + written)
        return {sid: tuple(int(t.item()) for t in ts) for sid, ts in lazy.items()}

    def forget(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)
        self.captured.pop(seq_id, None)


def load(model_dir: Path, model, tensors: dict[str, Path], block_tokens: int) -> Head:
    """The first MTP layer of ``model_dir`` (``tensors``: from :func:`find`) as a
    :class:`Head` over ``model``, in the model's compute dtype."""
    args = model.args
    n = args.num_hidden_layers
    prefix = f"model.layers.{n}."
    raw: dict[str, mx.array] = {}
    for path in sorted(set(tensors.values())):
        loaded = mx.load(str(path))
        raw.update({k: v for k, v in loaded.items() if k in tensors})
    # through the model's own sanitize as its layer 0 (experts stacked, dequantized as the
    # model's own layers are); then the names relative to the MTP layer
    renamed = {"model.layers.0." + k[len(prefix):]: v for k, v in raw.items()}
    if hasattr(model, "sanitize"):
        renamed = model.sanitize(renamed)
    weights = {k[len("model.layers.0."):]: v for k, v in renamed.items()
               if k.startswith("model.layers.0.")}
    ours = {"eh_proj.weight", "enorm.weight", "hnorm.weight"}
    layer_weights = {k: v for k, v in weights.items()
                     if k not in ours and not k.startswith(("shared_head.", "embed_tokens."))}
    own_norm = "shared_head.norm.weight" in weights
    own_head = "shared_head.head.weight" in weights
    layer = type(model.layers[-1])(args, n)
    head = Head(model, layer, own_norm, own_head, block_tokens)
    dtype = next(v.dtype for _, v in tree_flatten(model.parameters())
                 if mx.issubdtype(v.dtype, mx.floating))
    pairs = [(k, v) for k, v in weights.items() if k in ours]
    pairs += [("layer." + k, v) for k, v in layer_weights.items()]
    if own_norm:
        pairs.append(("norm.weight", weights["shared_head.norm.weight"]))
    if own_head:
        pairs.append(("head.weight", weights["shared_head.head.weight"]))
    head.load_weights([(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v)
                       for k, v in pairs], strict=True)
    head.eval()
    mx.eval(head.parameters())
    probe = Cache(0, block_tokens)  # one token through the layer: its KV bytes per token
    head._step(mx.array([[0]], dtype=mx.uint32), mx.zeros((1, 1, args.hidden_size), dtype),
               probe)
    mx.eval(probe.keys, probe.values)
    head.block_bytes = probe.nbytes  # the probe grew by one block of block_tokens
    return head


def attach(eng, model_dir: Path) -> tuple[Head | None, str]:
    """Load ``model_dir``'s MTP head over ``eng``'s model and hand it ``eng``'s hidden
    states (``eng.mtp``); (None, why) where the checkpoint has none or it cannot be built."""
    tensors, why = find(Path(model_dir))
    if why:
        return None, why
    with mx.stream(eng._stream):
        try:
            head = load(Path(model_dir), eng.model, tensors, eng.block_tokens)
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            return None, f"its MTP layer could not be built from the model's classes: {err}"
    head._stream = eng._stream
    eng.mtp = head
    return head, ""
