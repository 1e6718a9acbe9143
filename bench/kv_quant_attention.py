"""Quantized KV reads, by hand: which attention path the paged engine should take.

Two ways to attend over a table's quantized blocks (engine/quantized.py), same gather of
the packed values, scales and biases (the blocks, still quantized) first:

- ``dequant``: ``mx.dequantize`` the gathered K and V into the model's float dtype, then
  ``mx.fast.scaled_dot_product_attention`` (a float transient of rows × length × dim);
- ``qmatmul``: mlx-lm's ``quantized_scaled_dot_product_attention`` (two
  ``mx.quantized_matmul`` s and a softmax) straight on the quantized arrays.

One layer of the qwen3-0.6b shape (16 query heads, 8 KV heads, head_dim 128), float32 on the
CPU (bfloat16 elsewhere with --dtype), 8 and 4 bits, group 64, blocks of 16 scattered in the
pool: decode batches (rows × 1 query over ``length`` keys, a padding mask) and prefill chunks
(``chunk`` queries, causal, over ``length`` keys). Median of ``--repeats`` timed runs after a
warm-up; each figure is the ratio dequant ÷ qmatmul (> 1: qmatmul faster). Also the largest
difference of the outputs (they compute the same attention).

    python bench/kv_quant_attention.py            # writes bench/results/kv-quant-attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import quantized_scaled_dot_product_attention

HERE = Path(__file__).resolve().parent
HQ, HKV, DIM, BLOCK, GROUP = 16, 8, 128, 16, 64


def gathered(pool, index, length):
    rows, nb = index.shape
    out = []
    for a in pool:
        w = a.shape[-1]
        blocks = a.reshape(HKV, -1, BLOCK * w)[:, index]
        out.append(blocks.reshape(HKV, rows, nb * BLOCK, w).transpose(1, 0, 2, 3)[:, :, :length])
    return tuple(out)


def run_case(bits, dtype, rows, queries, length, repeats, rng):
    nb = -(-length // BLOCK)
    total = rows * nb + 8
    x = mx.random.normal((HKV, total * BLOCK, DIM)).astype(dtype)
    kpool = mx.quantize(x, group_size=GROUP, bits=bits)
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
        k, v = gathered(kpool, index, length), gathered(vpool, index, length)
        kf = mx.dequantize(*k, group_size=GROUP, bits=bits)
        vf = mx.dequantize(*v, group_size=GROUP, bits=bits)
        return mx.fast.scaled_dot_product_attention(q, kf, vf, scale=scale, mask=mask)

    def qmatmul():
        k, v = gathered(kpool, index, length), gathered(vpool, index, length)
        return quantized_scaled_dot_product_attention(q, k, v, scale=scale, mask=mask,
                                                      group_size=GROUP, bits=bits)

    out = {}
    for name, fn in (("dequant", dequant), ("qmatmul", qmatmul)):
        mx.eval(fn())
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            mx.eval(fn())
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times) * 1e3
    diff = float(mx.max(mx.abs(dequant().astype(mx.float32) - qmatmul().astype(mx.float32))))
    return {"bits": bits, "rows": rows, "queries": queries, "length": length,
            "dequant_ms": round(out["dequant"], 3), "qmatmul_ms": round(out["qmatmul"], 3),
            "dequant_over_qmatmul": round(out["dequant"] / out["qmatmul"], 3),
            "max_abs_diff": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=HERE / "results" / "kv-quant-attention.json")
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    rng = np.random.default_rng(0)
    cases = [(1, 1, 512), (1, 1, 4096), (8, 1, 512), (8, 1, 2048), (32, 1, 512),
             (1, 128, 2048), (1, 512, 4096)]
    results = []
    for bits in (8, 4):
        for rows, queries, length in cases:
            r = run_case(bits, dtype, rows, queries, length, a.repeats, rng)
            print(json.dumps(r), flush=True)
            results.append(r)
    doc = {"device": str(mx.default_device()), "mlx": mx.__version__, "dtype": a.dtype,
           "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": DIM, "block": BLOCK,
                     "group": GROUP}, "results": results,
           "command": f"python bench/kv_quant_attention.py --dtype {a.dtype} "
                      f"--repeats {a.repeats}"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
