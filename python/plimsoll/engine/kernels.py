"""Custom attention kernels, each checked on the device it will run on before use (imports mlx).

A kernel here computes what the reference path computes, faster: the paged decode
attention (rows of one query each over their block tables, K/V read in place from the
pool) — today :mod:`plimsoll.engine.paged_cuda` on MLX's CUDA backend. No kernel is trusted
on its word (neither this project's machines nor CI run every backend), so at engine start
:func:`select` takes each kernel registered (:data:`REGISTRY`) for the running backend
(:func:`plimsoll.engine.backend.name`) and, for the model's attention shape and dtype:

1. runs it on a few small random problems (scattered tables, rows of different lengths)
   against the reference — the tables' blocks gathered
   (:meth:`~plimsoll.engine.paged.FullAttention.gather`) and
   ``mx.fast.scaled_dot_product_attention`` with the padding mask — and requires the
   largest difference within :data:`TOLERANCE` for the dtype;
2. times both on the largest problem (best of :data:`RUNS`, each evaluated) and requires the
   kernel not slower than the reference × :data:`MARGIN` (a slower first measurement is
   measured again before it counts).

Quantized pools (engine/quantized.py) have their own variant of the decode kernel
(:data:`QUANTIZED`), checked the same way by :func:`check_quantized` on the float problems
quantized as the pools store them, against the pools' own dequantizing read.

A kernel is used only when both hold; otherwise the reference path serves and the reason
is kept (:class:`Verdict`): the worker reports every verdict in ``/v1/plimsoll/status``
(``kernels``) and ``plimsoll doctor`` runs the same check on its host. On the CPU nothing is
registered: the reference path is the default there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from plimsoll.engine import backend, paged_cuda, paged_metal, pool_cuda, skinny_cuda
from plimsoll.engine.paged import FullAttention, Read
from plimsoll.engine.quantized import QuantizedAttention

#: the largest |kernel − reference| allowed, by dtype (unit-normal inputs; f32 accumulation)
TOLERANCE = {mx.float32: 1e-4, mx.float16: 5e-3, mx.bfloat16: 2e-2}
MARGIN = 1.10  # a kernel more than 10 % slower than the reference is not used
RUNS = 5
#: (rows, lowest length, longest length) of the check's problems, blocks of 16 tokens
PROBLEMS = ((1, 33, 33), (4, 1, 300), (8, 100, 700))
BLOCK = 16


@dataclass(frozen=True)
class Kernel:
    """A paged decode kernel: ``decode(queries, k_pool, v_pool, tables, lengths, longest,
    scale, block_tokens, after=None)`` → (rows, q_heads, 1, dim), reading the pools after the
    in-place write whose token is ``after`` (engine/pool_cuda.py); ``serves(queries, k_dim,
    v_dim, kv_heads)`` says whether it computes that attention at all."""

    name: str
    device: str  # the backend it runs on: "cuda", "metal" or "cpu"
    decode: Callable[..., mx.array]
    serves: Callable[[mx.array, int, int, int], bool]
    #: ``decode_writing(queries, k_pool, v_pool, k_new, v_new, first, base, tables,
    #: lengths, longest, scale, block_tokens, after=None)`` → (attention, token): the decode
    #: of a step of decode rows storing their new K/V in place as it reads them
    #: (:func:`plimsoll.engine.paged_cuda.paged_decode_writing`,
    #: :func:`plimsoll.engine.decode_write.check_writing`), or None
    decode_writing: Callable[..., tuple[mx.array, mx.array]] | None = None


@dataclass(frozen=True)
class Verdict:
    """What the check found for one kernel on this process's device."""

    name: str
    device: str
    used: bool
    reason: str
    max_error: float | None = None
    kernel_ms: float | None = None
    reference_ms: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


REGISTRY: list[Kernel] = [
    Kernel("paged_decode_cuda", "cuda", paged_cuda.paged_decode, paged_cuda.serves,
           paged_cuda.paged_decode_writing),
    # never run by this project's machines (no Mac): used only where its check passes
    Kernel("paged_decode_metal", "metal", paged_metal.paged_decode, paged_metal.serves),
]


class Selection:
    """The verdicts of one engine's check; :attr:`decode` is the kernel in use, or None."""

    def __init__(self, verdicts: list[Verdict], decode: Kernel | None):
        self.verdicts, self.decode = verdicts, decode

    def report(self) -> list[dict]:
        return [v.as_dict() for v in self.verdicts]


def _padding_mask(lengths: mx.array, longest: int) -> mx.array:
    """(rows, 1, 1, longest): True at each row's first ``lengths[row]`` positions."""
    return (mx.arange(longest, dtype=mx.int32)[None, :] < lengths[:, None])[:, None, None, :]


def reference_decode(queries: mx.array, k_pool: mx.array, v_pool: mx.array, tables: mx.array,
                     lengths: mx.array, longest: int, scale: float,
                     block_tokens: int) -> mx.array:
    """The engine's own decode read: the tables' blocks gathered, then the fused attention
    with the padding mask (what :class:`~plimsoll.engine.attention.PagedView` runs)."""
    heads, slots, dim = k_pool.shape
    pool = FullAttention(heads, dim, v_pool.shape[2], k_pool.dtype, block_tokens,
                         slots // block_tokens, slots // block_tokens)
    pool.keys, pool.values, pool.blocks = k_pool, v_pool, slots // block_tokens
    keys, values = pool.gather(Read(index=tables, length=longest))
    mask = _padding_mask(lengths, longest)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _problem(rows: int, lo: int, hi: int, kv_heads: int, q_heads: int, dim: int,
             dtype: mx.Dtype, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=rows).astype(np.int32)
    nb = -(-int(lengths.max()) // BLOCK)
    blocks = rows * nb + 4
    tables = rng.permutation(blocks)[:rows * nb].reshape(rows, nb).astype(np.int32)
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    k_pool = mx.random.normal((kv_heads, blocks * BLOCK, dim), key=k1).astype(dtype)
    v_pool = mx.random.normal((kv_heads, blocks * BLOCK, dim), key=k2).astype(dtype)
    queries = mx.random.normal((rows, q_heads, 1, dim), key=k3).astype(dtype)
    return (queries, k_pool, v_pool, mx.array(tables), mx.array(lengths),
            int(lengths.max()), dim ** -0.5, BLOCK)


def _best_ms(fn: Callable[..., mx.array], args: tuple) -> float:
    best = float("inf")
    for _ in range(RUNS):
        t0 = time.perf_counter()
        mx.eval(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def decide(max_error: float, tolerance: float, kernel_ms: float, reference_ms: float) -> str:
    """Why a kernel is not used ("" when it is). Pure."""
    if not max_error <= tolerance:  # NaN disagrees too
        return f"disagrees with the reference: max error {max_error:.3g} > {tolerance:g}"
    if kernel_ms > reference_ms * MARGIN:
        return (f"slower than the reference: {kernel_ms:.3f} ms against {reference_ms:.3f} ms "
                "(best of each)")
    return ""


def check(kernel: Kernel, dtype: mx.Dtype, q_heads: int,
          shapes: list[tuple[int, int, int]], problem: Callable[..., tuple] = _problem,
          reference: Callable[..., mx.array] = reference_decode) -> Verdict:
    """Run ``kernel`` against ``reference`` on this device for every pool shape
    ``(kv_heads, k_dim, v_dim)`` of the model, on ``problem``'s problems (see the module
    docstring)."""
    tolerance = TOLERANCE.get(dtype, 2e-2)
    worst, times = 0.0, [0.0, 0.0]
    try:
        for kv_heads, k_dim, v_dim in shapes:
            if not kernel.serves(mx.zeros((1, q_heads, 1, k_dim), dtype), k_dim, v_dim,
                                 kv_heads):
                return Verdict(kernel.name, kernel.device, False,
                               f"does not serve this model's attention ({q_heads} query heads "
                               f"over {kv_heads} KV heads, K {k_dim} and V {v_dim} wide)")
            for seed, (rows, lo, hi) in enumerate(PROBLEMS):
                args = problem(rows, lo, hi, kv_heads, q_heads, k_dim, dtype, seed)
                got, want = kernel.decode(*args), reference(*args)
                err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
                worst = max(worst, err) if err == err else float("nan")
            for _ in range(2):  # a slower first measurement is confirmed once
                pair = (_best_ms(kernel.decode, args), _best_ms(reference, args))
                if not decide(worst, tolerance, *pair).startswith("slower"):
                    break
            times = [times[0] + pair[0], times[1] + pair[1]]
    except Exception as err:  # any failure of a kernel means: do not use it
        return Verdict(kernel.name, kernel.device, False,
                       f"failed on this device: {type(err).__name__}: {err}")
    why = decide(worst, tolerance, *times)
    return Verdict(kernel.name, kernel.device, not why,
                   why or "agrees with the reference and is not slower", worst,
                   round(times[0], 4), round(times[1], 4))


QUANTIZED = Kernel("paged_decode_quantized_cuda", "cuda", paged_cuda.paged_decode_quantized,
                   paged_cuda.serves)


def reference_decode_quantized(queries: mx.array, k_pool: tuple, v_pool: tuple,
                               tables: mx.array, lengths: mx.array, longest: int, scale: float,
                               block_tokens: int) -> mx.array:
    """The engine's own decode read of quantized pools (``k_pool``, ``v_pool``: packed
    values, scales, biases): :meth:`QuantizedAttention.attend_over` with the padding mask."""
    heads, slots, words = k_pool[0].shape
    dim, blocks = queries.shape[-1], slots // block_tokens
    pool = QuantizedAttention(heads, dim, dim, k_pool[1].dtype, block_tokens, blocks, blocks,
                              bits=words * 32 // dim, group_size=dim // k_pool[1].shape[-1])
    pool.keys, pool.values, pool.blocks = k_pool, v_pool, blocks
    mask = _padding_mask(lengths, longest)
    # a new array object: mlx-lm's quantized attention scales its queries in place
    # (``queries *= scale``), and the check hands the kernel the same queries again
    return pool.attend_over(mx.array(queries), scale, None, Read(index=tables, length=longest),
                            mask, None)


def check_quantized(pools: list[QuantizedAttention], dtype: mx.Dtype,
                    q_heads: int | None) -> Verdict | None:
    """Whether ``pools`` (the quantized full-attention ones) serve their decode rows through
    :data:`QUANTIZED` on this device: :func:`check` on quantized problems (the float
    problems quantized as the pools store them) against :func:`reference_decode_quantized`.
    None where the model has no quantized pool (nothing to say)."""
    if not pools:
        return None
    if (here := backend.name()) != QUANTIZED.device:
        return Verdict(QUANTIZED.name, QUANTIZED.device, False,
                       f"not this device: the engine runs on {here}")
    if not q_heads:
        return Verdict(QUANTIZED.name, QUANTIZED.device, False,
                       "the model's query heads are not known")
    bits, group = pools[0].bits, pools[0].group_size

    def problem(*args) -> tuple:
        queries, k_pool, v_pool, *rest = _problem(*args)
        return (queries, tuple(mx.quantize(k_pool, group_size=group, bits=bits)),
                tuple(mx.quantize(v_pool, group_size=group, bits=bits)), *rest)

    shapes = sorted({(p.kv_heads, p.k_dim, p.v_dim) for p in pools})
    return check(QUANTIZED, dtype, q_heads, shapes, problem, reference_decode_quantized)


def select(dtype: mx.Dtype, q_heads: int | None, shapes: list[tuple[int, int, int]],
           registry: list[Kernel] | None = None) -> Selection:
    """Check every kernel of ``registry`` (default :data:`REGISTRY`) meant for this
    process's backend on the model's decode attention (``q_heads`` query heads over each
    float pool shape ``(kv_heads, k_dim, v_dim)``); the first that passes is used."""
    here = backend.name()
    verdicts, chosen = [], None
    for kernel in REGISTRY if registry is None else registry:
        if kernel.device != here:
            verdicts.append(Verdict(kernel.name, kernel.device, False,
                                    f"not this device: the engine runs on {here}"))
        elif not shapes or not q_heads:
            verdicts.append(Verdict(kernel.name, kernel.device, False,
                                    "the model has no float full-attention pool to read"))
        elif chosen is not None:
            verdicts.append(Verdict(kernel.name, kernel.device, False,
                                    f"{chosen.name} is used for the decode already"))
        else:
            verdict = check(kernel, dtype, q_heads, shapes)
            verdicts.append(verdict)
            if verdict.used:
                chosen = kernel
    return Selection(verdicts, chosen)


def _matmul(x: mx.array, w: mx.array) -> mx.array:
    return x @ w.T


def _skinny_shapes(ws: list[mx.array]) -> tuple:
    """``(shapes, reason, max error, kernel ms, reference ms)`` of the few-row kernel on the
    model's own weights ``ws`` (one of each shape): ``x`` unit-normal at every row count it
    takes (each count's code is built here, not mid-step), the largest difference from
    ``x @ w.T`` relative to the largest output; per weight, the times at
    :data:`~plimsoll.engine.skinny_cuda.CHECK_ROWS` rows (best of :data:`RUNS` each) summed.
    ``shapes``: the weights' ``(n, k, dtype)`` it is used for — none unless it agrees within
    :data:`TOLERANCE` on every one, and of those the ones where it is not slower; the times
    are the totals over those."""
    if not ws:
        return set(), "the model has no bf16/f16 linear weight it could take", None, None, None
    worst, mine, ref, faster = 0.0, 0.0, 0.0, set()
    try:
        for w in ws:
            mine_w = ref_w = 0.0
            for rows in range(2, skinny_cuda.MAX_ROWS + 1):
                x = mx.random.normal((rows, w.shape[1]), key=mx.random.key(rows)).astype(w.dtype)
                got = skinny_cuda.skinny(x, w).astype(mx.float32)
                want = _matmul(x, w).astype(mx.float32)
                err = (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-6)).item()
                worst = max(worst, err) if err == err else float("nan")
                if not worst <= TOLERANCE.get(w.dtype, 2e-2):
                    return (set(), f"disagrees with x @ w.T: relative error {worst:.3g} at "
                            f"{rows} rows of {tuple(w.shape)}", worst, None, None)
                if rows in skinny_cuda.CHECK_ROWS:
                    mine_w += _best_ms(skinny_cuda.skinny, (x, w))
                    ref_w += _best_ms(_matmul, (x, w))
            if mine_w <= ref_w:
                faster.add(skinny_cuda.shape_key(w))
                mine, ref = mine + mine_w, ref + ref_w
    except Exception as err:  # any failure of a kernel means: do not use it
        return set(), f"failed on this device: {type(err).__name__}: {err}", None, None, None
    if not faster:
        return set(), "slower than x @ w.T on every weight of the model", worst, None, None
    return (faster, f"agrees with x @ w.T; not slower on {len(faster)} of {len(ws)} weight "
            "shapes, used there", worst, round(mine, 4), round(ref, 4))


def check_skinny(model) -> Verdict:
    """Whether ``model``'s linear layers take steps of 2-8 rows through
    :mod:`plimsoll.engine.skinny_cuda` on this device (:func:`_skinny_shapes`); installed on
    the weight shapes where it passes."""
    if (here := backend.name()) != "cuda":  # the model is not even looked at
        return Verdict(skinny_cuda.NAME, "cuda", False, f"not this device: the engine runs on "
                       f"{here}")
    shapes, why, err, mine, ref = _skinny_shapes(skinny_cuda.weights(model))
    if shapes:
        skinny_cuda.install(model, shapes=shapes)
    return Verdict(skinny_cuda.NAME, "cuda", bool(shapes), why, err, mine, ref)


WRITE_KERNEL = "pool_write_cuda"
GATHER_KERNEL = "pool_gather_cuda"


def _pool_refusal(name: str, pools: list[FullAttention]) -> Verdict | None:
    """Why a pool kernel is not even checked here (None: check it)."""
    here, device = backend.name(), "cuda"
    if here != device:
        return Verdict(name, device, False, f"not this device: the engine runs on {here}")
    if not pools:
        return Verdict(name, device, False, "the model has no float full-attention pool")
    return None


def _pool_shapes(pools: list[FullAttention]) -> set[tuple[int, int, mx.Dtype]]:
    """(KV heads, row width, dtype) of every K and V array of ``pools``."""
    return {(p.kv_heads, d, p.dtype) for p in pools for d in (p.k_dim, p.v_dim)}


def check_write(pools: list[FullAttention], compiled: bool, gather: Verdict) -> Verdict:
    """Whether ``pools`` (the plain full-attention ones) take their writes in place through
    :mod:`plimsoll.engine.pool_cuda` on this device: its check on each pool shape and
    dtype; only where the pools gather through its kernel (``gather``, that kernel's
    verdict: every read of a pool written in place must take the write's token, and MLX's
    own gather and slices cannot); never for compiled decode steps (their writes are the
    traced function's scatters)."""
    if refused := _pool_refusal(WRITE_KERNEL, pools):
        return refused
    if not gather.used:
        return Verdict(WRITE_KERNEL, "cuda", False, "the pools do not gather through "
                       f"{GATHER_KERNEL} ({gather.reason}): MLX's gather could not wait for "
                       "a write in place")
    if compiled:
        return Verdict(WRITE_KERNEL, "cuda", False, "decode steps are compiled "
                       "(--compile-decode): their pool writes are the traced scatters")
    for kv_heads, dim, dtype in _pool_shapes(pools):
        if why := pool_cuda.check_write(dtype, kv_heads, dim):
            return Verdict(WRITE_KERNEL, "cuda", False, why)
    return Verdict(WRITE_KERNEL, "cuda", True, "stores in place what the scatter stores")


def check_gather(pools: list[FullAttention]) -> Verdict:
    """Whether ``pools`` (the plain full-attention ones) gather a chunk's context through
    :func:`plimsoll.engine.pool_cuda.gather` on this device: its check on each pool shape
    and dtype against the pool's own MLX gather."""
    if refused := _pool_refusal(GATHER_KERNEL, pools):
        return refused
    bt = pools[0].block_tokens

    def mlx_gather(pool: mx.array, index: mx.array, length: int) -> mx.array:
        heads, slots, dim = pool.shape
        plain = FullAttention(heads, dim, dim, pool.dtype, bt, slots // bt, slots // bt)
        plain.keys = plain.values = pool
        plain.blocks = slots // bt
        return plain.gather(Read(index=index, length=length))[0]

    for kv_heads, dim, dtype in _pool_shapes(pools):
        if why := pool_cuda.check_gather(dtype, kv_heads, dim, bt, mlx_gather):
            return Verdict(GATHER_KERNEL, "cuda", False, why)
    return Verdict(GATHER_KERNEL, "cuda", True, "copies what the gather copies, not slower")
