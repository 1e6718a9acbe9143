"""The paged decode kernel in Metal (engine/paged_metal.py), as far as a Linux box can check it.

No Mac runs here or in CI, so the kernel never runs in these tests; what they pin down: its
source is Metal's (no CUDA name left in it), its arithmetic is the CUDA kernel's statement for
statement (that one has run and checked itself on an H200), it takes only attentions whose
partial results fit a threadgroup, and where it cannot run the engine's check refuses it with
the reason and the gather path serves.
"""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from plimsoll.engine import kernels, paged_cuda, paged_metal

#: the thread attributes MLX's metal_kernel adds to a kernel's signature when its body uses them
MLX_METAL_ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup", "dispatch_simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup", "grid_origin", "grid_size",
    "quadgroup_index_in_threadgroup", "quadgroups_per_threadgroup",
    "simdgroup_index_in_threadgroup", "simdgroups_per_threadgroup", "thread_execution_width",
    "thread_index_in_quadgroup", "thread_index_in_simdgroup", "thread_index_in_threadgroup",
    "thread_position_in_grid", "thread_position_in_threadgroup",
    "threadgroup_position_in_grid", "threadgroups_per_grid", "threads_per_grid",
    "threads_per_simdgroup", "threads_per_threadgroup"}
CUDA_ONLY = ("__shfl", "__syncthreads", "__shared__", "blockIdx", "threadIdx", "blockDim",
             "gridDim", "__expf", "__int_as_float", "fmaxf", "expf(")
SOURCES = {"attend": paged_metal._ATTEND, "partial": paged_cuda.PARTIAL_OUT,
           "direct": paged_cuda.DIRECT_OUT, "combine": paged_metal._COMBINE}


@pytest.mark.parametrize("part", sorted(SOURCES))
def test_source_is_metal(part):
    src = SOURCES[part]
    assert not [name for name in CUDA_ONLY if name in src]
    used = set(re.findall(r"\b(?:thread|threads|threadgroup|threadgroups|simdgroup|quadgroup)"
                          r"\w*_(?:grid|threadgroup|simdgroup|quadgroup)\b", src))
    assert used <= MLX_METAL_ATTRIBUTES, used - MLX_METAL_ATTRIBUTES
    assert "infinity" not in src  # fast math: a finite lowest score


def _statements(src: str) -> list[str]:
    return [line.strip() for line in src.splitlines() if line.strip()]


#: CUDA's spelling -> Metal's, for the statements both kernels share
_SPELLING = (("fmaxf(", "metal::max("), ("__expf(", "metal::exp("), ("expf(", "metal::exp("),
             (" min(", " metal::min("), ("0.f", "0.0f"))


@pytest.mark.parametrize(("cuda", "metal"), [
    (paged_cuda._ATTEND.split("__LOAD__")[1], paged_metal._ATTEND),
    (paged_cuda._COMBINE, paged_metal._COMBINE),
])
def test_arithmetic_is_the_cuda_kernels(cuda, metal):
    """Every statement after the CUDA kernel's load (the softmax update, the warps' merge, the
    output's index) and of its combine is in the Metal kernel, in CUDA's order, up to the two
    languages' names for max and exp (the tails that write the results are one text for
    both): a change to the one that has run on a GPU shows here."""
    mine = _statements(metal)
    at = 0
    for line in _statements(cuda):
        if any(token in line for token in ("__shfl", "__shared__", "__syncthreads", "threadIdx",
                                           "blockDim", "blockIdx", "__int_as_float")):
            continue  # thread ids, the reduction, shared memory, barrier, lowest score: Metal's
        for old, new in _SPELLING:
            line = line.replace(old, new)
        assert line in mine[at:], line
        at = mine.index(line, at) + 1


def test_index_arithmetic_matches_the_cuda_kernels():
    """The lines that place a token and a split (the block table's slot, the span, the output
    offset) are the CUDA kernel's, word for word."""
    for line in ("const int slot = tables[b * MB + t / BT] * BT + t % BT;",
                 "const int span = (MB * BT + NS - 1) / NS;", "const int lo = split * span;",
                 "const size_t o = ((size_t)(b * HQ + kvh * G + g)) * NS + split;"):
        assert line in _statements(paged_cuda._ATTEND)
        assert line in _statements(paged_metal._ATTEND)


def test_serves_what_fits_a_threadgroup():
    q = mx.zeros((1, 32, 1, 128))
    assert paged_metal.serves(q, 128, 128, 8)  # Qwen3-4B: 4 query heads a group
    assert not paged_metal.serves(q, 128, 64, 8)  # K and V widths differ
    assert not paged_metal.serves(mx.zeros((1, 32, 1, 80)), 80, 80, 8)  # not a simdgroup multiple
    assert not paged_metal.serves(mx.zeros((1, 32, 2, 128)), 128, 128, 8)  # two queries a row
    wide = mx.zeros((1, 64, 1, 128))
    assert paged_metal.threadgroup_bytes(32, 128) > paged_metal.THREADGROUP_BYTES
    assert not paged_metal.serves(wide, 128, 128, 2)  # 32 heads a group: too much memory
    assert paged_metal.serves(wide, 128, 128, 8)


def test_not_checked_off_metal():
    """On this box's CPU backend the Metal kernel is not even run: the verdict says why."""
    sel = kernels.select(mx.float32, 8, [(2, 32, 32)])
    verdict = {v.name: v for v in sel.verdicts}["paged_decode_metal"]
    assert not verdict.used and verdict.device == "metal"
    assert verdict.reason == "not this device: the engine runs on cpu"
    assert sel.decode is None


def test_refused_with_the_reason_where_it_cannot_run(monkeypatch):
    """The engine's check on a backend that calls itself Metal: this MLX build has no Metal,
    so the real kernel fails at its first problem, and the check refuses it with MLX's own
    message — the gather path serves (what a Mac whose compiler rejected the source gets)."""
    monkeypatch.setattr(kernels.backend, "name", lambda: "metal")
    sel = kernels.select(mx.float32, 8, [(2, 32, 32)])
    verdict = {v.name: v for v in sel.verdicts}["paged_decode_metal"]
    assert sel.decode is None and not verdict.used
    assert verdict.reason.startswith("failed on this device: RuntimeError:")
    assert "Metal" in verdict.reason
    cuda = {v.name: v for v in sel.verdicts}["paged_decode_cuda"]
    assert cuda.reason == "not this device: the engine runs on metal"


def test_one_launch_for_both_backends():
    """:func:`paged_cuda.launch` (the CUDA kernel's launch and the Metal one's): one launch of
    the direct kernel without splits; with them the partial kernel, then the combine over its
    three outputs — the grid, threadgroup and output shapes each kernel is handed."""
    calls = []

    def kernel_of(which):
        def run(**kw):
            calls.append((which, kw))
            return [mx.zeros(s, dtype=t) for s, t in zip(kw["output_shapes"],
                                                         kw["output_dtypes"], strict=True)]
        return run

    q = mx.zeros((3, 8, 1, 64), dtype=mx.float16)
    out = paged_cuda.launch(kernel_of, ["inputs"], q, 2, [("T", mx.float16)], 1)
    assert out.shape == (3, 8, 1, 64) and [c[0] for c in calls] == ["direct"]
    assert calls[0][1]["grid"] == (3 * 32 * paged_cuda.WARPS, 2, 1)
    assert calls[0][1]["threadgroup"] == (32 * paged_cuda.WARPS, 1, 1)
    calls.clear()
    out = paged_cuda.launch(kernel_of, ["inputs"], q, 2, [("T", mx.float16)], 5)
    assert [c[0] for c in calls] == ["partial", "combine"] and out.dtype == mx.float16
    assert calls[0][1]["grid"] == (3 * 32 * paged_cuda.WARPS, 2, 5)
    assert calls[0][1]["output_shapes"] == [(3, 8, 5, 64), (3, 8, 5), (3, 8, 5)]
    assert [a.shape for a in calls[1][1]["inputs"]] == [(3, 8, 5, 64), (3, 8, 5), (3, 8, 5)]
    assert calls[1][1]["grid"][0] >= 3 * 8 * 64 and calls[1][1]["template"][1] == ("D", 64)
