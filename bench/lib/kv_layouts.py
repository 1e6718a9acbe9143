"""Two KV layouts measured in process for bench/engine.py: sliding-window rings, quantized reads.

:func:`window`: a random-weight gemma3_text-shaped model (5 of 6 layers sliding, as gemma-3)
is generated to ``--tokens`` tokens twice, by mlx-lm's ``generate_step`` with its
``make_prompt_cache`` (``RotatingKVCache`` for the sliding layers, ``KVCache`` for the
global ones) and by the engine; at each checkpoint the ``nbytes`` each side holds, window
layers and full layers apart, and what the model facts (admission) count.

:func:`attention`: the two ways to attend over a table's quantized blocks, after the same
gather of the packed values, scales and biases: ``dequant`` (``mx.dequantize`` into the float
dtype, then ``mx.fast.scaled_dot_product_attention``: a float transient of rows × length ×
dim) and ``qmatmul`` (mlx-lm's ``quantized_scaled_dot_product_attention``: two quantized
matmuls and a softmax). One layer of the qwen3-0.6b shape (16 query heads, 8 KV heads,
head_dim 128), 8 and 4 bits, group 64, blocks of 16 scattered in the pool: decode batches
(rows × 1 query over ``length`` keys, a padding mask) and prefill chunks (``chunk`` queries,
causal). Each figure is dequant ÷ qmatmul (> 1: qmatmul faster), with the largest difference
of the outputs (they compute the same attention).
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

from lib import report
from lib.engine import BLOCK

HQ, HKV, DIM, GROUP = 16, 8, 128, 64
CASES = [(1, 1, 512), (1, 1, 4096), (8, 1, 512), (8, 1, 2048), (32, 1, 512), (1, 128, 2048),
         (1, 512, 4096)]  # (rows, queries, length)


def build_gemma3(out: Path, window: int) -> Path:
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, save_config, save_model
    from plimsoll.demo import tokenizer as tokenizer_build

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
    save_config(config, out / "config.json")
    tokenizer_build.write_tokenizer_files(out, tokenizer_build.train_tokenizer(512), 4096)
    return out


def _mlx_side(eng, prompt: list[int], total: int, marks: list[int]) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    caches = make_prompt_cache(eng.model)
    out, at = {}, len(prompt)
    for _ in generate_step(mx.array(prompt), eng.model, max_tokens=total - len(prompt),
                           prompt_cache=caches):
        at += 1
        if at in marks:
            out[at] = {"window": sum(c.nbytes for c in caches if isinstance(c, RotatingKVCache)),
                       "full": sum(c.nbytes for c in caches
                                   if not isinstance(c, RotatingKVCache))}
    return out


def _engine_side(eng, prompt: list[int], total: int, marks: list[int]) -> dict:
    import mlx.core as mx
    from plimsoll.engine.window import WindowAttention
    from plimsoll.engine.work import Step, Work

    windows = [k for k in eng.layers if isinstance(k, WindowAttention)]
    table = tuple(range(math.ceil(total / BLOCK)))
    out = {}
    tok = eng.run(Step(prefills=(Work(0, tuple(prompt), 0, table, True),)))[0]
    at = len(prompt) + 1  # tokens whose KV is written after the next decode
    while at <= total:
        tok = eng.run(Step(decodes=(Work(0, (tok,), at - 1, table, True),)))[0]
        if at in marks:
            mx.eval([x for k in windows for x in k.arrays()])
            out[at] = {"window": sum(k.nbytes for k in windows),
                       # full layers: the blocks this sequence's table has written
                       "full": math.ceil(at / BLOCK) * eng.block_bytes}
        at += 1
    eng.free_state(0)
    return out


def window(a) -> dict:
    from plimsoll.core.model_facts import inspect_model
    from plimsoll.engine import Engine

    with tempfile.TemporaryDirectory() as tmp:
        path = build_gemma3(Path(tmp) / "model", a.window)
        facts = inspect_model(path)
        eng = Engine.load(path, block_tokens=BLOCK, max_blocks=a.tokens // BLOCK + 2)
        prompt = [(7 * i) % 500 + 1 for i in range(a.prompt)]
        marks = sorted({m for m in (a.prompt + 1, a.window, 2 * a.window, a.tokens // 2,
                                    a.tokens) if a.prompt < m <= a.tokens})
        mine = _engine_side(eng, prompt, a.tokens, marks)
        theirs = _mlx_side(eng, prompt, a.tokens, marks)
    rows = [{"tokens": m, "plimsoll_window_bytes": mine[m]["window"],
             "mlx_lm_window_bytes": theirs[m]["window"],
             "facts_window_bytes": facts.fixed_bytes(m),
             "plimsoll_full_bytes": mine[m]["full"], "mlx_lm_full_bytes": theirs[m]["full"],
             # every layer a full KVCache, as an engine without window layers holds it
             "full_if_unwindowed_bytes": (facts.kv_bytes_per_token
                                          + facts.fixed_bytes(None) // a.window) * m}
            for m in marks]
    return {"model": "gemma3_text-shaped, 12 layers (10 sliding), 1 KV head x 256, float32",
            "window": a.window, "prompt": a.prompt, "rows": rows}


def window_md(r: dict) -> list[str]:
    keys = ["plimsoll_window_bytes", "mlx_lm_window_bytes", "facts_window_bytes",
            "plimsoll_full_bytes", "mlx_lm_full_bytes", "full_if_unwindowed_bytes"]
    return [f"{r['model']}, window {r['window']}, prompt {r['prompt']}. Bytes are the "
            "``nbytes`` of the arrays each side holds after that many tokens; facts are what "
            "admission counts.", "",
            *report.table(["tokens", "plimsoll window B", "mlx-lm window B", "facts window B",
                           "plimsoll full B", "mlx-lm full B", "all layers unwindowed B"],
                          [[row["tokens"], *(row[k] for k in keys)] for row in r["rows"]])]


def _gathered(pool, index, length):
    rows, nb = index.shape
    out = []
    for x in pool:
        w = x.shape[-1]
        blocks = x.reshape(HKV, -1, BLOCK * w)[:, index]
        out.append(blocks.reshape(HKV, rows, nb * BLOCK, w).transpose(1, 0, 2, 3)[:, :, :length])
    return tuple(out)


def _case(bits: int, dtype, rows: int, queries: int, length: int, repeats: int, rng) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    nb = -(-length // BLOCK)
    total = rows * nb + 8
    kpool = mx.quantize(mx.random.normal((HKV, total * BLOCK, DIM)).astype(dtype),
                        group_size=GROUP, bits=bits)
    vpool = mx.quantize(mx.random.normal((HKV, total * BLOCK, DIM)).astype(dtype),
                        group_size=GROUP, bits=bits)
    mx.eval(kpool, vpool)
    index = mx.array(rng.permutation(total)[:rows * nb].reshape(rows, nb).astype(np.int32))
    q = mx.random.normal((rows, HQ, queries, DIM)).astype(dtype)
    scale = DIM ** -0.5
    if queries == 1:
        lengths = np.linspace(max(1, length // 2), length, rows).astype(int)
        mask = mx.array(np.arange(length)[None] < lengths[:, None])[:, None, None, :]
    else:
        mask = "causal"

    def dequant():
        k, v = _gathered(kpool, index, length), _gathered(vpool, index, length)
        kf = mx.dequantize(*k, group_size=GROUP, bits=bits)
        vf = mx.dequantize(*v, group_size=GROUP, bits=bits)
        return mx.fast.scaled_dot_product_attention(q, kf, vf, scale=scale, mask=mask)

    def qmatmul():
        k, v = _gathered(kpool, index, length), _gathered(vpool, index, length)
        return quantized_scaled_dot_product_attention(q, k, v, scale=scale, mask=mask,
                                                      group_size=GROUP, bits=bits)

    ms = {}
    for name, fn in (("dequant", dequant), ("qmatmul", qmatmul)):
        mx.eval(fn())
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            mx.eval(fn())
            times.append(time.perf_counter() - t)
        ms[name] = statistics.median(times) * 1e3
    diff = float(mx.max(mx.abs(dequant().astype(mx.float32) - qmatmul().astype(mx.float32))))
    return {"bits": bits, "rows": rows, "queries": queries, "length": length,
            "dequant_ms": round(ms["dequant"], 3), "qmatmul_ms": round(ms["qmatmul"], 3),
            "dequant_over_qmatmul": round(ms["dequant"] / ms["qmatmul"], 3),
            "max_abs_diff": diff}


def attention(a) -> dict:
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    results = []
    for bits in (8, 4):
        for rows, queries, length in CASES:
            results.append(_case(bits, getattr(mx, a.dtype), rows, queries, length, a.repeats,
                                 rng))
            print(results[-1], flush=True)
    return {"dtype": a.dtype, "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": DIM,
                                        "block": BLOCK, "group": GROUP}, "results": results}


def attention_md(r: dict) -> list[str]:
    by = {(x["bits"], x["rows"], x["queries"], x["length"]): x for x in r["results"]}

    def case(rows: int, queries: int, length: int) -> str:
        return (f"decode, {rows} row{'s' if rows > 1 else ''} × {length}" if queries == 1
                else f"prefill chunk {queries} × {length}")

    return [f"Ratio dequant ÷ qmatmul (> 1: qmatmul faster), {r['dtype']}, milliseconds in "
            "the JSON.", "",
            *report.table(["case", "8 bit", "4 bit"],
                          [[case(*c), *(by[(b, *c)]["dequant_over_qmatmul"] for b in (8, 4))]
                           for c in CASES])]
