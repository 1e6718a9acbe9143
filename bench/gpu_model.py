"""Build a random-weight Qwen3-4B-shaped model in the real mlx-lm layout, in seconds on a GPU.

The model of the GPU runs (bench/serving.py, bench/overhead.py, bench/cuda_probes.py): 36
layers, hidden 2560, 32 query / 8 KV heads, head_dim 128, intermediate 9728, vocab 151936,
tied embeddings, max_position_embeddings 40960, bf16 — weights 7.49 GiB, KV 144 KiB per
token. An 8 GB model is too big to carry to a machine with no network, and random weights are
generated there faster than they could be copied.

The tokenizer is plimsoll's locally trained byte-level BPE (:mod:`plimsoll.demo.tokenizer`,
``--tokenizer-vocab`` tokens, the chat template with tools), its vocabulary then padded with
``<|pad_N|>`` entries up to the model's 151936 ids: every id the model can emit decodes (the
padding is unreachable from text, so encoding is unchanged).

``--mtp`` builds the same shape as GLM-4's layout (``glm4_moe``, every layer dense, tied
embeddings off) with one random MTP layer (``num_nextn_predict_layers`` 1: the tensors of
``model.layers.{n}.*`` that mlx-lm's sanitize drops and the worker's MTP head loads), for
bench/speculative.py's ``--mtp``: random weights, so its drafts are nearly all rejected and
what is measured is the head's cost at the adaptive draft length.

``--shape small`` builds the same layout with a tiny shape, to check this script on a CPU;
``--shape micro`` (2 layers, hidden 128) is bench/overhead.py's model, where the serving
stack's Python per step, not the model, is what is measured.
The build is atomic (a temp dir renamed into place); an existing complete build is reused.

    python3 bench/gpu_model.py /tmp/qwen3-4b-shaped
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "qwen3-4b": {"hidden_size": 2560, "num_hidden_layers": 36, "intermediate_size": 9728,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "vocab_size": 151936},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
              "vocab_size": 8192},
    # bench/overhead.py's model: so small that the server's Python per step dominates
    "micro": {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "vocab_size": 4096},
    # bench/host_build.py's model: the 4B model's 36 layers at micro width (the graph a step
    # builds on the host has the 4B model's ops; their compute is next to nothing)
    "deep": {"hidden_size": 128, "num_hidden_layers": 36, "intermediate_size": 256,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "vocab_size": 4096},
}
BASE = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
        "sliding_window": None, "use_sliding_window": False,
        "max_position_embeddings": 40960, "tie_word_embeddings": True}
#: GLM-4's layout (glm4_moe) for --mtp; first_k_dense_replace past every layer, the MTP's
#: too, keeps each layer a dense MLP of the shape's intermediate size
GLM = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "attention_bias": False,
       "partial_rotary_factor": 0.5, "use_qk_norm": True, "n_routed_experts": 4,
       "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
       "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
       "rms_norm_eps": 1e-5, "rope_theta": 1000000, "rope_scaling": None,
       "max_position_embeddings": 40960, "tie_word_embeddings": False,
       "num_nextn_predict_layers": 1}
MARKER = "demo-model.json"


def say(t0: float, line: str) -> None:
    print(f"[gpu_model {time.perf_counter() - t0:6.1f}s] {line}", flush=True)


def pad_tokenizer(path: Path, vocab_size: int) -> int:
    """Add unreachable ``<|pad_N|>`` entries to tokenizer.json's BPE vocabulary until it has
    ``vocab_size`` ids; return how many were added."""
    data = json.loads(path.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    # Added tokens outside the model's vocabulary get ids after it when the file is loaded
    # (the ids written beside them are ignored), so pin each one into the vocabulary first.
    for added in data.get("added_tokens", []):
        vocab.setdefault(added["content"], added["id"])
    n = max(vocab.values()) + 1
    if sorted(vocab.values()) != list(range(n)):
        raise ValueError("the tokenizer's ids are not contiguous; cannot pad it")
    if n > vocab_size:
        raise ValueError(f"the tokenizer has {n} ids, more than the model's {vocab_size}")
    for i in range(n, vocab_size):
        token = f"<|pad_{i}|>"
        if token in vocab:
            raise ValueError(f"{token} is already in the vocabulary")
        vocab[token] = i
    path.write_text(json.dumps(data, ensure_ascii=False))
    return vocab_size - n


def mtp_tensors(model, n: int, dtype, seed: int) -> dict:
    """A random MTP layer at index ``n`` in the checkpoint's own names: eh_proj, the two
    norms, the shared head's norm and a decoder layer of the model's class."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.random.seed(seed + 1)
    hidden = model.args.hidden_size
    layer = type(model.layers[-1])(model.args, n)
    layer.set_dtype(dtype)
    out = {f"model.layers.{n}.{k}": v for k, v in tree_flatten(layer.parameters())}
    out[f"model.layers.{n}.eh_proj.weight"] = (
        mx.random.normal((hidden, 2 * hidden)) * (2 * hidden) ** -0.5).astype(dtype)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        out[f"model.layers.{n}.{name}.weight"] = mx.ones((hidden,), dtype)
    return out


def build(out: Path, shape: str, dtype: str, seed: int, tok_vocab: int,
          mtp: bool = False) -> Path:
    t0 = time.perf_counter()
    wanted = {"preset": f"{shape}-shaped" + ("-glm4-mtp" if mtp else ""), "dtype": dtype,
              "seed": seed}
    marker = out / MARKER
    if marker.is_file():
        found = json.loads(marker.read_text())
        if all(found.get(k) == v for k, v in wanted.items()):
            say(t0, f"{out} already holds {wanted}")
            return out
        raise SystemExit(f"{out} holds another build ({found}); remove it or choose another path")
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import glm4_moe, qwen3
    from mlx_lm.utils import save_config, save_model
    from plimsoll.demo import tokenizer as tb

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        say(t0, f"training the tokenizer ({tok_vocab} tokens) on {mx.default_device()}'s host")
        tok = tb.train_tokenizer(tok_vocab)
        ids = tb.token_ids(tok)
        layout = {**GLM, "first_k_dense_replace": SHAPES[shape]["num_hidden_layers"] + 1} \
            if mtp else BASE
        config = {**layout, **SHAPES[shape], "torch_dtype": dtype,
                  "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                  "pad_token_id": ids["<|endoftext|>"]}
        tb.write_tokenizer_files(tmp, tok, config["max_position_embeddings"])
        padded = pad_tokenizer(tmp / "tokenizer.json", config["vocab_size"])
        say(t0, f"tokenizer padded with {padded} unreachable ids to {config['vocab_size']}")
        mx.random.seed(seed)
        arch = glm4_moe if mtp else qwen3
        model = arch.Model(arch.ModelArgs.from_dict(config))
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
        nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        say(t0, f"initialised {nbytes / 2**30:.2f} GiB of {dtype} weights; saving")
        save_model(tmp, model)
        if mtp:  # beside the model's files, named in its index as a checkpoint's are
            n = config["num_hidden_layers"]
            extra = mtp_tensors(model, n, getattr(mx, dtype), seed)
            mx.save_safetensors(str(tmp / "model-mtp.safetensors"), extra,
                                metadata={"format": "mlx"})
            index_path = tmp / "model.safetensors.index.json"
            if index_path.exists():
                index = json.loads(index_path.read_text())
            else:
                index = {"metadata": {}, "weight_map": {
                    k: "model.safetensors" for k, _ in tree_flatten(model.parameters())}}
            index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
            index_path.write_text(json.dumps(index, indent=2))
            say(t0, f"MTP layer {n}: {sum(v.nbytes for v in extra.values()) / 2**20:.0f} MiB")
        save_config(dict(config), tmp / "config.json")
        gen = {"bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
               "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        (tmp / MARKER).write_text(json.dumps({**wanted, "random_weights": True,
                                              "weights_bytes": nbytes, "files": files},
                                             indent=2))
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(t0, f"built {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-vocab", type=int, default=None,
                   help="tokens the tokenizer learns (default 32768, at most the shape's vocab)")
    p.add_argument("--mtp", action="store_true",
                   help="GLM-4's layout (glm4_moe, dense) with one random MTP layer")
    args = p.parse_args(argv)
    tok_vocab = args.tokenizer_vocab or min(32768, SHAPES[args.shape]["vocab_size"])
    build(args.out.expanduser().resolve(), args.shape, args.dtype, args.seed, tok_vocab,
          args.mtp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
