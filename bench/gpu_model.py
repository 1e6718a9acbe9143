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
}
BASE = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
        "sliding_window": None, "use_sliding_window": False,
        "max_position_embeddings": 40960, "tie_word_embeddings": True}
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


def build(out: Path, shape: str, dtype: str, seed: int, tok_vocab: int) -> Path:
    t0 = time.perf_counter()
    wanted = {"preset": f"{shape}-shaped", "dtype": dtype, "seed": seed}
    marker = out / MARKER
    if marker.is_file():
        found = json.loads(marker.read_text())
        if all(found.get(k) == v for k, v in wanted.items()):
            say(t0, f"{out} already holds {wanted}")
            return out
        raise SystemExit(f"{out} holds another build ({found}); remove it or choose another path")
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3
    from mlx_lm.utils import save_config, save_model
    from plimsoll.demo import tokenizer as tb

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        say(t0, f"training the tokenizer ({tok_vocab} tokens) on {mx.default_device()}'s host")
        tok = tb.train_tokenizer(tok_vocab)
        ids = tb.token_ids(tok)
        config = {**BASE, **SHAPES[shape], "torch_dtype": dtype,
                  "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                  "pad_token_id": ids["<|endoftext|>"]}
        tb.write_tokenizer_files(tmp, tok, config["max_position_embeddings"])
        padded = pad_tokenizer(tmp / "tokenizer.json", config["vocab_size"])
        say(t0, f"tokenizer padded with {padded} unreachable ids to {config['vocab_size']}")
        mx.random.seed(seed)
        model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
        nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        say(t0, f"initialised {nbytes / 2**30:.2f} GiB of {dtype} weights; saving")
        save_model(tmp, model)
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
    p.add_argument("--tokenizer-vocab", type=int, default=32768)
    args = p.parse_args(argv)
    build(args.out.expanduser().resolve(), args.shape, args.dtype, args.seed,
          args.tokenizer_vocab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
