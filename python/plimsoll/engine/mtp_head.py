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

The head is a model of one layer that a second :class:`~plimsoll.engine.core.Engine` runs
(:func:`attach`), as a draft model is run: its KV is a bounded paged pool of as many blocks
as the target's, addressed by the target's block tables (position ``j`` of the head's KV
sits at the target's slot ``j``), and every drafting sequence is a row of one batch. Besides
its tokens, each call reads one hidden state per token, handed in before the step
(:meth:`Head.feed`, in the step's row order: decodes first, then each chunk), and keeps its
layer's output at the rows that sample, which the next draft step is fed
(:meth:`Head.chain`: the head reused past its depth, as vLLM and SGLang do).

The target hands its hidden states over from its one forward: while :attr:`Engine.mtp` is
a :class:`Hidden` (set by :func:`attach`), every step keeps each sequence's rows of the last
decoder layer's output, lazily (:mod:`.sampled_rows` captures them before the rows that
sample are cut). Drafts are proposals only: the target verifies them, so nothing here
changes the output.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask

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


class Hidden:
    """The target's hidden states handed over, per sequence: ``[(start, rows)]``, oldest
    first (lazy arrays; the latest capture of a position wins, so the rows of rejected
    drafts are overwritten before they are read)."""

    def __init__(self, norm):
        self._norm = norm  # the target's final norm (its hidden states are read under it)
        self.captured: dict[int, list[tuple[int, mx.array]]] = {}

    def take(self, seq_id: int, start: int, rows: mx.array) -> None:
        """The target's last-layer output at ``start ..`` for ``seq_id`` (lazy)."""
        self.captured.setdefault(seq_id, []).append((start, rows))

    def first(self, seq_id: int) -> int | None:
        """The first position captured for ``seq_id`` (None: none)."""
        return min((s for s, _ in self.captured.get(seq_id, ())), default=None)

    def span(self, seq_id: int, lo: int, hi: int) -> tuple[int, mx.array | None]:
        """The latest captured rows for positions ``lo ..``, as far as they are contiguous
        and below ``hi``, under the final norm: (the end reached, the rows)."""
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
        if not out:
            return lo, None
        return at, self._norm(out[0] if len(out) == 1 else mx.concatenate(out))

    def keep_from(self, seq_id: int, position: int) -> None:
        """Drop the captures that hold nothing at or past ``position``."""
        if seq_id in self.captured:
            self.captured[seq_id] = [(s, r) for s, r in self.captured[seq_id]
                                     if s + r.shape[0] > position]

    def forget(self, seq_id: int) -> None:
        self.captured.pop(seq_id, None)


class Head(nn.Module):
    """The MTP layer as a model of one layer (see the module docstring); ``model``'s
    embedding, final norm and lm head are used, never copied (held outside the module's
    parameters)."""

    def __init__(self, model, layer: nn.Module, own_norm: bool, own_head: bool):
        super().__init__()
        args = model.args
        self.enorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.layers = [layer]
        if own_norm:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if own_head:
            self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self._target = [model]  # a list: not a child module (its weights are not ours)
        self._hidden_size = args.hidden_size
        self._feed: mx.array | None = None
        self._at = 0
        self._outs: list[mx.array] = []

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

    def feed(self, parts: list[mx.array] | None) -> None:
        """The hidden states of the next step's tokens, one row each, in the step's row
        order (None: zeros, as for the engine's own probes)."""
        hidden = None if not parts else parts[0] if len(parts) == 1 else mx.concatenate(parts)
        self._feed, self._at, self._outs = hidden, 0, []

    def chain(self, rows: list[int]) -> None:
        """Feed the next step the layer's output at ``rows`` of the rows that sampled in
        the step before (in order): each draft step reads the head's own output."""
        outs = self._outs[0] if len(self._outs) == 1 else mx.concatenate(self._outs)
        if rows != list(range(outs.shape[0])):
            outs = outs[mx.array(rows, dtype=mx.int32)]
        self.feed([outs])

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        n, dim = inputs.size, self._hidden_size
        embedded = self.enorm(self._lm().embed_tokens(inputs))
        if self._feed is None:
            hidden = mx.zeros((*inputs.shape, dim), embedded.dtype)
        else:  # a model called once per group reads its rows in turn
            hidden = self._feed[self._at:self._at + n].reshape(*inputs.shape, dim)
            self._at += n
        x = self.eh_proj(mx.concatenate([embedded, self.hnorm(hidden)], axis=-1))
        cache = cache[0] if cache else None
        out = self.layers[0](x, create_attention_mask(x, cache), cache)
        self._outs.append(out.reshape(-1, dim))  # the sampled rows (sampled_rows cut them)
        return self._logits(out)

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))


def load(model_dir: Path, model, tensors: dict[str, Path]) -> Head:
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
    head = Head(model, layer, own_norm, own_head)
    dtype = next(v.dtype for _, v in tree_flatten(model.parameters())
                 if mx.issubdtype(v.dtype, mx.floating))
    pairs = [(k, v) for k, v in weights.items() if k in ours]
    pairs += [("layers.0." + k, v) for k, v in layer_weights.items()]
    if own_norm:
        pairs.append(("norm.weight", weights["shared_head.norm.weight"]))
    if own_head:
        pairs.append(("head.weight", weights["shared_head.head.weight"]))
    head.load_weights([(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v)
                       for k, v in pairs], strict=True)
    head.eval()
    mx.eval(head.parameters())
    return head


def head_facts(facts, weights_bytes: int):
    """The target's facts for a model of one layer like its last: what the head's engine
    sizes and checks its pool by."""
    last = facts.num_layers - 1
    caches = tuple(c.model_copy(update={"layers": (0,)}) for c in facts.caches
                   if last in c.layers)
    per_token = sum(c.bytes_per_token for c in caches) if caches \
        else facts.kv_bytes_per_token // max(1, facts.kv_layers)
    return facts.model_copy(update={
        "num_layers": 1, "kv_layers": 1, "sliding_layers": 0, "caches": caches,
        "kv_bytes_per_token": per_token, "per_sequence_fixed_bytes": 0,
        "weights_bytes": weights_bytes, "mtp_weights_bytes": 0, "notes": []})


def attach(eng, model_dir: Path):
    """Load ``model_dir``'s MTP head over ``eng``'s model and run it on an engine of its
    own, whose pools take ``eng``'s block ids; ``eng`` hands it its hidden states
    (``eng.mtp``, a :class:`Hidden`). (head engine, None) or (None, why) where the
    checkpoint has none or the head cannot be built."""
    from plimsoll.engine.core import Engine  # the head runs on the engine it is part of

    tensors, why = find(Path(model_dir))
    if why:
        return None, why
    with mx.stream(eng._stream):
        try:
            head = load(Path(model_dir), eng.model, tensors)
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            return None, f"its MTP layer could not be built from the model's classes: {err}"
    try:
        runner = Engine(head, eng.tokenizer, head_facts(eng.facts, head.weights_bytes),
                        block_tokens=eng.block_tokens, max_blocks=eng.max_blocks,
                        context=eng.context)
    except NotImplementedError as err:
        return None, f"its MTP layer cannot run on the paged engine: {err}"
    if not runner.select_rows:
        return None, ("its MTP layer's output cannot be cut to the rows that sample, which "
                      "its drafts chain on")
    eng.mtp = Hidden(head._lm().norm)
    return runner, ""
