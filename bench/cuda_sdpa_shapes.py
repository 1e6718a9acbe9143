"""MLX CUDA attention by shape: a cuDNN plan build on each new (query, key) shape vs a cached plan,
with cuDNN on and off (MLX_CUDA_USE_CUDNN_SDPA=0). H200 only; results in
bench/results/cuda-attention-h200.md.

    python3 bench/cuda_sdpa_shapes.py; MLX_CUDA_USE_CUDNN_SDPA=0 python3 bench/cuda_sdpa_shapes.py
"""
# ruff: noqa: B023  (each lambda is timed inside its own loop iteration)
import os
import time

import mlx.core as mx

H, KV, D = 32, 8, 128
def t(fn, n=5):
    t0 = time.perf_counter(); mx.eval(fn()); first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n): mx.eval(fn())
    return round(first*1000, 1), round((time.perf_counter()-t0)/n*1000, 2)
pool_k = mx.random.normal((KV, 40000, D)).astype(mx.bfloat16)
pool_v = mx.random.normal((KV, 40000, D)).astype(mx.bfloat16)
mx.eval(pool_k, pool_v)
print("cudnn env", os.environ.get("MLX_CUDA_USE_CUDNN_SDPA"), flush=True)
for L, K in ((512, 512), (512, 4608), (512, 4624), (512, 16896), (2048, 18432), (4096, 20480), (2720, 2720)):
    q = mx.random.normal((1, H, L, D)).astype(mx.bfloat16)
    kc = mx.contiguous(pool_k[None, :, :K]); vc = mx.contiguous(pool_v[None, :, :K]); mx.eval(q, kc, vc)
    ks, vs = pool_k[None, :, 1024:1024 + K], pool_v[None, :, 1024:1024 + K]
    r = {}
    r["contig causal"] = t(lambda: mx.fast.scaled_dot_product_attention(q, kc, vc, scale=0.088, mask="causal"))
    r["slice causal"] = t(lambda: mx.fast.scaled_dot_product_attention(q, ks, vs, scale=0.088, mask="causal"))
    r["contig nomask"] = t(lambda: mx.fast.scaled_dot_product_attention(q, kc, vc, scale=0.088))
    m = mx.arange(K)[None, :] <= (mx.arange(L)[:, None] + K - L)
    r["contig boolmask"] = t(lambda: mx.fast.scaled_dot_product_attention(q, kc, vc, scale=0.088, mask=m))
    print(L, K, r, flush=True)
