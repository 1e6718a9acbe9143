"""The linear layers' kept transposed views (engine/linear.py), real MLX on the CPU.

What is claimed: the same outputs as mlx's ``nn.Linear`` bit for bit, for every input shape
a model gives a projection; fewer graph nodes (the reason for it); no bytes of their own; a
replaced weight is read, eagerly and through ``mx.compile``; and an engine's greedy tokens
equal those of mlx-lm's own model loaded apart (plain modules), single and batched.
"""

from __future__ import annotations

import io
import re

import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")
mlx_lm = pytest.importorskip("mlx_lm")

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine, linear  # noqa: E402
from plimsoll.engine.drive import Blocks, drive, reference, seqs_for, sharpen, text  # noqa: E402

SHAPES = [(5, 16), (1, 1, 16), (1, 7, 16), (4, 1, 16), (3, 5, 16), (2, 2, 3, 16), (16,)]


def nodes(y: mx.array) -> list[str]:
    out = io.StringIO()
    mx.export_to_dot(out, y)
    return re.findall(r'label ="([A-Za-z]\w*)"', out.getvalue())


class Box(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.proj = nn.Linear(16, 24, bias=bias)
        self.embed = nn.Embedding(40, 16)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_held_outputs_equal_mlx_linear_bit_for_bit(shape, bias):
    box = Box(bias)
    x = mx.random.normal(shape)
    before = (box.proj(x), box.embed.as_linear(x))
    assert linear.hold(box) == 2
    assert type(box.proj) is linear.HeldLinear and type(box.embed) is linear.HeldEmbedding
    for _ in range(2):  # the first call makes the views, the second reads them
        after = (box.proj(x), box.embed.as_linear(x))
        for a, b in zip(before, after, strict=True):
            assert a.shape == b.shape and mx.array_equal(a, b).item()
    assert linear.release(box) == 2 and type(box.proj) is nn.Linear
    assert mx.array_equal(box.proj(x), before[0]).item()


def test_a_projection_is_one_node_where_mlx_makes_four():
    box = Box(bias=False)
    one_row, rows, chunk = (mx.random.normal(s) for s in ((1, 1, 16), (4, 1, 16), (1, 9, 16)))
    mx.eval(box.parameters(), one_row, rows, chunk)
    assert sorted(nodes(box.proj(one_row))) == ["Flatten", "Matmul", "Transpose", "Unflatten"]
    linear.hold(box)
    assert nodes(box.proj(one_row)) == ["Matmul"]
    assert nodes(box.embed.as_linear(one_row)) == ["Matmul"]
    assert nodes(box.proj(chunk)) == ["Matmul"]  # a prompt chunk
    # several batch rows on the CPU: the flattened call, without the Transpose
    assert sorted(nodes(box.proj(rows))) == ["Flatten", "Matmul", "Unflatten"]


def test_the_views_hold_no_bytes_of_their_own():
    w = mx.random.normal((2048, 1024))  # 8 MiB
    lin = nn.Linear(1024, 2048, bias=False)
    lin.weight = w
    mx.eval(w)
    linear.hold(lin)
    before = mx.get_active_memory()
    mx.eval(lin(mx.random.normal((1, 1, 1024))))
    assert mx.get_active_memory() - before < w.nbytes // 16


def test_a_replaced_weight_is_read_eagerly_and_when_compiled():
    lin = nn.Linear(16, 8, bias=False)
    linear.hold(lin)
    x = mx.random.normal((1, 1, 16))
    fn = mx.compile(lambda v: lin(v), inputs=lin.state)
    first, compiled = lin(x), fn(x)
    assert mx.array_equal(first, compiled).item()
    lin.weight = lin.weight * 2
    assert mx.allclose(lin(x), 2 * first).item()
    assert mx.allclose(fn(x), 2 * first).item()  # the trace read its input, not a kept view


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("linear"), "tiny", dtype="float32")


def test_an_engine_holds_its_projections_and_equals_mlx_lm_loaded_apart(tiny_dir):
    eng = Engine.load(tiny_dir, block_tokens=16, max_blocks=64)
    held = [m for _, m in eng.model.named_modules() if type(m) in linear.HELD.values()]
    assert held and not [m for _, m in eng.model.named_modules()
                         if type(m) in (nn.Linear, nn.Embedding)]
    plain, _ = mlx_lm.load(str(tiny_dir))
    assert not [m for _, m in plain.named_modules() if type(m) in linear.HELD.values()]
    sharpen(eng.model)
    sharpen(plain)
    prompts = [text(eng.tokenizer, n, salt=n) for n in (1, 20, 45, 33)]
    got = drive(eng, seqs_for(prompts, 8, 16, Blocks(64, shuffle=True)), chunk=16)
    assert got == [reference(plain, p, 8) for p in prompts]
