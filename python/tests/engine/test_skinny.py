"""The linear layers' few-row path (engine/skinny_cuda.py), on the CPU.

The CUDA kernel itself runs only on MLX's CUDA backend (its check there compares it with
``x @ w.T`` on the model's own weights before it is used). Here, real MLX on the CPU: which
calls it takes, and the plumbing that sends them to it — a model's ``nn.Linear`` and tied
embedding modules given the subclass, with a stand-in matmul — leaves a bf16 engine's greedy
tokens equal to mlx-lm's while the stand-in sees exactly the steps of 2-8 rows.
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine, backend, kernels, skinny_cuda  # noqa: E402
from plimsoll.engine.drive import Blocks, drive, reference, seqs_for, sharpen, text  # noqa: E402


def test_which_calls_it_takes():
    w = mx.zeros((24, 16), dtype=mx.bfloat16)
    x = mx.zeros((4, 16), dtype=mx.bfloat16)
    assert [skinny_cuda.takes(r, x, w) for r in (0, 1, 2, 5, 8, 9, 32)] == [
        False, False, True, True, True, False, False]
    assert not skinny_cuda.takes(4, x.astype(mx.float16), w)  # dtypes differ
    assert not skinny_cuda.takes(4, x.astype(mx.float32), w.astype(mx.float32))
    assert not skinny_cuda.takes(4, mx.zeros((4, 12), mx.bfloat16), mx.zeros((24, 12),
                                                                             mx.bfloat16))


def test_the_layout_gives_tall_weights_wider_blocks():
    assert skinny_cuda.layout(2, 1024) == (2, 4)
    assert skinny_cuda.layout(8, 4096) == (2, 4)
    assert skinny_cuda.layout(4, 9728) == (2, 8)
    assert skinny_cuda.layout(5, 9728) == (4, 8)
    assert skinny_cuda.layout(8, 151936) == (4, 8)


def test_the_modules_send_few_rows_through_it_and_keep_their_bias():
    calls = []

    def stand_in(x, w):
        calls.append(x.shape[0])
        return x @ w.T

    class Box(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 24, bias=True)
            self.embed = nn.Embedding(40, 16)

    box = Box()
    box.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 3, 16)).astype(mx.bfloat16)
    before = (box.proj(x), box.embed.as_linear(x), box.proj(x[:, :1]))
    assert skinny_cuda.install(box, stand_in) == 2
    after = (box.proj(x), box.embed.as_linear(x), box.proj(x[:, :1]))
    assert calls == [3, 3]  # one row stays on the layer's own path
    for a, b in zip(before, after, strict=True):  # the bias added after, not fused: rounding
        assert a.shape == b.shape and mx.allclose(a, b, rtol=1e-2, atol=1e-2).item()
    assert mx.array_equal(before[1], after[1]).item()  # no bias: the very same matmul


def test_a_bf16_engine_through_the_stand_in_equals_mlx_lm(tmp_path):
    eng = Engine.load(build_demo_model(tmp_path, "tiny", dtype="bfloat16"), block_tokens=16,
                      max_blocks=64)
    sharpen(eng.model)
    calls = []

    def stand_in(x, w):
        calls.append(x.shape[0])
        return x @ w.T

    assert skinny_cuda.install(eng.model, stand_in) > 0
    prompts = [text(eng.tokenizer, n, salt=n) for n in (20, 45, 33)]
    got = drive(eng, seqs_for(prompts, 6, 16, Blocks(64, shuffle=True)), chunk=64)
    assert got == [reference(eng.model, p, 6) for p in prompts]
    assert calls and set(calls) <= set(range(2, 9))  # the decode steps of 2-3 rows


@pytest.mark.skipif(backend.name() == "cuda", reason="the CPU's verdict")
def test_the_cpu_is_told_why_not(tmp_path):
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=64)
    verdict = kernels.check_skinny(eng.model)
    assert verdict.name == skinny_cuda.NAME and not verdict.used
    assert verdict.reason == "not this device: the engine runs on cpu"
    assert not any(isinstance(m, skinny_cuda.SkinnyLinear) for _, m in eng.model.named_modules())
    # the weights it would be checked on: one of each (shape, dtype), float32 ones excluded;
    # none of an object that is not a module (a cluster rank's stage)
    assert skinny_cuda.weights(eng.model) == []
    assert skinny_cuda.weights(object()) == [] and skinny_cuda.install(object()) == 0
