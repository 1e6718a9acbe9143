"""Bytes held for sliding-window layers as one sequence grows: plimsoll's rings against
mlx-lm's own caches, in process. By hand, not a test.

A random-weight gemma3_text-shaped model (5 of 6 layers sliding, as gemma-3; a window of
``--window`` tokens) is generated to ``--tokens`` tokens twice: by mlx-lm's
``generate_step`` with its ``make_prompt_cache`` (``RotatingKVCache`` for the sliding
layers, ``KVCache`` for the global ones), and by :class:`plimsoll.engine.Engine`. At each
checkpoint the bytes each side really holds (``nbytes`` of its arrays), split into window
layers and full layers, and what model facts (admission) count for them. Run::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      PYTHONPATH=python python bench/window_memory.py --json bench/results/window_memory.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.utils import _get_classes, save_config, save_model
from plimsoll.core.model_facts import inspect_model
from plimsoll.demo import tokenizer as tokenizer_build
from plimsoll.engine import Engine
from plimsoll.engine.window import WindowAttention
from plimsoll.engine.work import Step, Work

BLOCK = 16


def build(out: Path, window: int) -> Path:
    config = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
              "vocab_size": 512, "torch_dtype": "float32", "max_position_embeddings": 32768,
              "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 256, "intermediate_size": 512, "num_hidden_layers": 12,
              "query_pre_attn_scalar": 256, "sliding_window": window,
              "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    tok = tokenizer_build.train_tokenizer(512)
    save_config(config, out / "config.json")
    tokenizer_build.write_tokenizer_files(out, tok, 4096)
    return out


def mlx_side(eng: Engine, prompt: list[int], total: int, marks: list[int]) -> dict:
    caches = make_prompt_cache(eng.model)
    out, at = {}, len(prompt)
    for _ in generate_step(mx.array(prompt), eng.model, max_tokens=total - len(prompt),
                           prompt_cache=caches):
        at += 1
        if at in marks:
            win = sum(c.nbytes for c in caches if isinstance(c, RotatingKVCache))
            full = sum(c.nbytes for c in caches if not isinstance(c, RotatingKVCache))
            out[at] = {"window": win, "full": full}
    return out


def engine_side(eng: Engine, prompt: list[int], total: int, marks: list[int]) -> dict:
    windows = [k for k in eng.layers if isinstance(k, WindowAttention)]
    table = tuple(range(math.ceil(total / BLOCK)))
    out = {}
    tok = eng.run(Step(prefills=(Work(0, tuple(prompt), 0, table, True),)))[0]
    at = len(prompt) + 1  # tokens whose KV is written after the next decode
    while at <= total:
        tok = eng.run(Step(decodes=(Work(0, (tok,), at - 1, table, True),)))[0]
        if at in marks:
            mx.eval([a for k in windows for a in k.arrays()])
            out[at] = {"window": sum(k.nbytes for k in windows),
                       # full layers: the blocks this sequence's table has written
                       "full": math.ceil(at / BLOCK) * eng.block_bytes}
        at += 1
    eng.free_state(0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / "model", a.window)
        facts = inspect_model(path)
        eng = Engine.load(path, block_tokens=BLOCK, max_blocks=a.tokens // BLOCK + 2)
        prompt = [(7 * i) % 500 + 1 for i in range(a.prompt)]
        marks = sorted({m for m in (a.prompt + 1, a.window, 2 * a.window, a.tokens // 2,
                                    a.tokens) if a.prompt < m <= a.tokens})
        mine = engine_side(eng, prompt, a.tokens, marks)
        theirs = mlx_side(eng, prompt, a.tokens, marks)
    rows = []
    for m in marks:
        rows.append({"tokens": m, "plimsoll_window_bytes": mine[m]["window"],
                     "mlx_lm_window_bytes": theirs[m]["window"],
                     "facts_window_bytes": facts.fixed_bytes(m),
                     "plimsoll_full_bytes": mine[m]["full"],
                     "mlx_lm_full_bytes": theirs[m]["full"],
                     # every layer a full KVCache: what the engine held before this work
                     "full_if_unwindowed_bytes": (facts.kv_bytes_per_token
                                                  + facts.fixed_bytes(None) // a.window) * m})
    doc = {"model": "gemma3_text-shaped, 12 layers (10 sliding), 1 KV head x 256, float32",
           "window": a.window, "prompt": a.prompt, "rows": rows}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
        md = [("| tokens | plimsoll window B | mlx-lm window B | facts window B | "
               "plimsoll full B | mlx-lm full B | all layers unwindowed B |"),
              "|---|---|---|---|---|---|---|"]
        md += [f"| {r['tokens']} | {r['plimsoll_window_bytes']} | {r['mlx_lm_window_bytes']} "
               f"| {r['facts_window_bytes']} | {r['plimsoll_full_bytes']} | "
               f"{r['mlx_lm_full_bytes']} | {r['full_if_unwindowed_bytes']} |" for r in rows]
        a.json.with_suffix(".md").write_text(
            f"# Sliding-window bytes held ({doc['model']}, window {a.window}, prompt "
            f"{a.prompt})\n\nCommand (OpenBLAS preloaded, CPU float32): `PYTHONPATH=python "
            f"python {' '.join(sys.argv)}`\n\nBytes are the ``nbytes`` of the arrays each side "
            "holds after that many tokens; facts are what admission counts.\n\n"
            + "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
