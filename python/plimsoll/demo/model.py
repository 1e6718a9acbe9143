"""Random-weight demo models in the real mlx-lm layout, built offline.

Tests, demos and benchmarks need models that ``mlx_lm.load(dir)`` accepts like
any download, with the memory shape of a real one, on machines with no hub.
Throughput and memory do not depend on weight values, so the weights are random
(mlx-lm's own model classes, initialised under ``mx.random.seed(seed)``) and the
tokenizer is trained locally (:mod:`plimsoll.demo.tokenizer`).

This is the engine edge: mlx and mlx_lm are imported inside functions only, so
importing this module stays cheap.

Invariants:

- a build is atomic: everything is written into a temp dir beside ``out_dir``
  and renamed into place, so a crash leaves nothing half-built;
- ``demo-model.json`` is written last and lists every file; its presence with
  the same preset/dtype/seed is what makes a directory "already built";
- the same preset, dtype and seed give bit-identical weights (for one mlx version).

Answers that end: random weights almost never sample the end-of-turn token, so every
answer runs to its ``max_tokens`` — and coding clients treat an answer cut at its limit as
a failure (Claude Code and Codex exit 1). ``eos_bias`` (the embedded default's demo, what
``plimsoll serve`` runs) builds the same shapes with one hidden dimension made constant
(every token's embedding is 1 there and no layer writes it) and the end-of-turn token's
embedding raised there by ``eos_bias``: its logit then leads the others' by a constant, so
a sampled answer (temperature 1) ends after a few dozen tokens of noise and a greedy one at
once. Builds without it are bit-identical to before.

Known limits: mlx's CPU backend runs MoE (GatherMM) in float32 only, so the
``hybrid`` preset (MoE, like the real Qwen3-Next) built in bfloat16 loads but
cannot generate on a CPU; build it in float32 there. ``qwen3-0.6b`` takes ~30 s
on two cores (mlx's random generator fills 596 M parameters, then 2.4 GB are
written in float32).

On a CPU-only Linux box, bf16 matmuls are slow; float32 generation through
OpenBLAS is ~70× faster. Run generation with
``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0`` if
libopenblas0-pthread is installed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from plimsoll.core.units import fmt_bytes
from plimsoll.demo import tokenizer as tokenizer_build

Preset = Literal["tiny", "hybrid", "qwen3-0.6b"]
Dtype = Literal["float32", "bfloat16"]
MARKER = "demo-model.json"
_FORMAT = 1

_QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
          "attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
          "rope_theta": 1000000, "rope_scaling": None, "sliding_window": None,
          "use_sliding_window": False, "max_position_embeddings": 40960}

PRESETS: dict[str, dict] = {
    # A few M params, GQA 8:2, builds in seconds.
    "tiny": {**_QWEN3, "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
             "vocab_size": 4096, "tie_word_embeddings": True},
    # Qwen3-Next in miniature: every 4th layer full attention, the rest gated delta net.
    "hybrid": {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
               "hidden_size": 256, "num_hidden_layers": 8, "full_attention_interval": 4,
               "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
               "head_dim": 64, "linear_num_value_heads": 8, "linear_num_key_heads": 4,
               "linear_key_head_dim": 32, "linear_value_head_dim": 32,
               "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
               "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 64,
               "shared_expert_intermediate_size": 64, "norm_topk_prob": True,
               "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_scaling": None,
               "rms_norm_eps": 1e-6, "vocab_size": 4096, "max_position_embeddings": 262144,
               "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu"},
    # The real Qwen3-0.6B shape (vocab padded past the locally trained tokenizer).
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "num_hidden_layers": 28,
                   "intermediate_size": 3072, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "tie_word_embeddings": True},
}
_TOKENIZER_VOCAB = {"tiny": 4096, "hybrid": 4096, "qwen3-0.6b": 32768}

_README = """# Random-weight demo model ({preset})

Built by `plimsoll demo-model` (preset `{preset}`, dtype `{dtype}`, seed {seed}).
The weights are RANDOM: this model produces gibberish. It has the memory shape of
a real `{model_type}` model and loads with `mlx_lm.load()`; use it for tests,
demos and benchmarks only. The tokenizer is a byte-level BPE of {tok_vocab} tokens
trained on Python standard-library sources; the model's vocabulary rows past it
are zero.
"""


def _say(progress: Callable[[str], None] | None, line: str) -> None:
    if progress is not None:
        progress(line)


def _marker(preset: str, dtype: str, seed: int, files: list[str], eos_bias: float = 0.0
            ) -> dict:
    extra = {"eos_bias": eos_bias} if eos_bias else {}
    return {"format": _FORMAT, "preset": preset, "dtype": dtype, "seed": seed, **extra,
            "random_weights": True, "files": sorted(files)}


def _bias_eos(model, eos_id: int, used_vocab: int, bias: float) -> None:
    """Make the end-of-turn token lead every logit by a constant (see the module's doc)."""
    inner = getattr(model, "model", model)
    for layer in inner.layers:
        if not (hasattr(layer, "self_attn") and hasattr(layer.self_attn, "o_proj")
                and hasattr(getattr(layer, "mlp", None), "down_proj")):
            raise ValueError("eos_bias needs dense attention and MLP layers (the tiny and "
                             "qwen3-0.6b presets)")
        layer.self_attn.o_proj.weight[0] = 0  # no layer writes hidden dimension 0 ...
        layer.mlp.down_proj.weight[0] = 0
    for table in [inner.embed_tokens] + ([model.lm_head] if hasattr(model, "lm_head") else []):
        table.weight[:used_vocab, 0] = 1.0  # ... so it is 1 at every position
        table.weight[eos_id, 0] = 1.0 + bias


def existing_build(out_dir: Path) -> dict | None:
    """The marker of a complete demo model at ``out_dir``, or None if it is not one."""
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, list) or not all((out_dir / f).is_file() for f in files):
        return None
    return marker


def _validate(preset: str, dtype: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"unknown dtype {dtype!r}; choose float32 or bfloat16")


def model_config(preset: str, dtype: str, ids: dict[str, int]) -> dict:
    """config.json contents: the preset's architecture plus dtype and special-token ids."""
    _validate(preset, dtype)
    return {**PRESETS[preset], "torch_dtype": dtype, "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}


def _write_weights(out: Path, config: dict, dtype: str, seed: int, used_vocab: int,
                   progress: Callable[[str], None] | None, eos_bias: float = 0.0) -> None:
    """Instantiate mlx-lm's model class for ``config`` with seeded random weights and save it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, save_config, save_model

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    # Rows past the tokenizer are never fed in; zero them so greedy decoding prefers
    # real tokens (a padded vocabulary, as in the real Qwen3 checkpoints).
    inner = getattr(model, "model", model)
    heads = [inner.embed_tokens] + ([model.lm_head] if hasattr(model, "lm_head") else [])
    for layer in heads:
        if layer.weight.shape[0] > used_vocab:
            layer.weight[used_vocab:] = 0
    if eos_bias:
        _bias_eos(model, config["eos_token_id"], used_vocab, eos_bias)
    mx.eval(model.parameters())
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    _say(progress, f"saving {fmt_bytes(nbytes)} of weights")
    save_model(out, model)
    save_config(dict(config), out / "config.json")


def _build_into(tmp: Path, preset: str, dtype: str, seed: int,
                progress: Callable[[str], None] | None, eos_bias: float = 0.0) -> None:
    _say(progress, f"training tokenizer ({_TOKENIZER_VOCAB[preset]} tokens)")
    tok = tokenizer_build.train_tokenizer(_TOKENIZER_VOCAB[preset])
    ids = tokenizer_build.token_ids(tok)
    config = model_config(preset, dtype, ids)
    tokenizer_build.write_tokenizer_files(tmp, tok, config["max_position_embeddings"])
    _say(progress, f"initialising {config['model_type']} weights ({dtype}, seed {seed})")
    _write_weights(tmp, config, dtype, seed, tok.get_vocab_size(), progress, eos_bias)
    generation = {"bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
                  "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (tmp / "README.md").write_text(_README.format(
        preset=preset, dtype=dtype, seed=seed, model_type=config["model_type"],
        tok_vocab=tok.get_vocab_size()))
    files = [p.name for p in tmp.iterdir() if p.is_file()]
    (tmp / MARKER).write_text(json.dumps(_marker(preset, dtype, seed, files, eos_bias),
                                         indent=2))


def _matches(out: Path, wanted: dict) -> bool:
    marker = existing_build(out)
    return marker is not None and all(marker.get(k) == v for k, v in wanted.items())


def _check_target(out: Path, wanted: dict) -> bool:
    """True if ``out`` already holds the wanted build; raise if it holds anything else."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    if out.is_dir() and _matches(out, wanted):
        return True
    marker = existing_build(out) if out.is_dir() else None
    found = {k: marker.get(k) for k in wanted} if marker else "not a complete demo model"
    raise FileExistsError(f"{out} is not empty ({found}); choose another directory or "
                          f"remove it to build {wanted}")


def build_demo_model(out_dir: str | Path, preset: Preset = "tiny", dtype: Dtype = "float32",
                     seed: int = 0, progress: Callable[[str], None] | None = None,
                     eos_bias: float = 0.0) -> Path:
    """Build a random-weight model that ``mlx_lm.load`` accepts; return its directory.

    An existing complete build with the same preset, dtype and seed is returned as
    is (also when a concurrent builder wins the final rename); any other non-empty
    ``out_dir`` is refused (FileExistsError) rather than overwritten. Bad arguments
    are ValueErrors. Sets mlx's global random seed as a side effect.
    """
    out = Path(out_dir).expanduser().resolve()
    _validate(preset, dtype)
    wanted = {"preset": preset, "dtype": dtype, "seed": seed,
              **({"eos_bias": eos_bias} if eos_bias else {})}
    if _check_target(out, wanted):
        _say(progress, f"{out} already holds this demo model")
        return out
    # ``out`` is the caller's; the server's own (under the cache) is made private first
    # (launch.defaults.ensure_demo_model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        _build_into(tmp, preset, dtype, seed, progress, eos_bias)
        tmp.chmod(0o755)
        try:
            tmp.rename(out)  # atomic; replaces an empty out_dir on POSIX
        except OSError:
            if not _matches(out, wanted):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    _say(progress, f"built {preset} demo model in {out}")
    return out
