"""Which MLX backend this process computes on: one probe for the whole engine (imports mlx).

:func:`name` is ``"cuda"`` (MLX's CUDA backend: the default device is a GPU that is not
Metal), ``"metal"`` (the Apple GPU) or ``"cpu"`` (the default device is the CPU, whatever
else the build has). Every backend-dependent choice of the engine reads it: the fused
prefill attention, the quantized decode path, the custom kernels' device
(:mod:`plimsoll.engine.kernels`), the warm-up. Read once: the default device does not change
after the engine starts.
"""

from __future__ import annotations

import functools

import mlx.core as mx


@functools.cache
def name() -> str:
    """``"cuda"``, ``"metal"`` or ``"cpu"``: where this process's arrays are computed."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    return "metal" if metal_available() else "cuda"


#: the multiple a causal prefill chunk's attention queries and keys are put on, on CUDA
#: (engine.attention.causal_on_grid): cuDNN builds a plan for every new (queries, keys)
#: shape, 40-55 ms each on an H200 (bench/results/cuda-attention-h200-2026-12-01.md), and a
#: chunk at a prefix has a new key length almost every time. On a 512 grid a 40k context has
#: ~400 shapes in all, which an idle worker builds ahead (engine.warmup.PlanWarmer)
CUDA_CAUSAL_GRID = 512


def causal_grid() -> int:
    """The multiple a causal chunk's attention shape is padded to here (0: none; the CPU
    and Metal kernels have no per-shape plans)."""
    return CUDA_CAUSAL_GRID if name() == "cuda" else 0


def gpu() -> bool:
    return name() != "cpu"


def metal_available() -> bool:
    """Whether this build of MLX has a Metal GPU (the wired limit is Metal's alone)."""
    try:
        return bool(mx.metal.is_available())
    except AttributeError:  # builds without the metal module (CPU, CUDA)
        return False
