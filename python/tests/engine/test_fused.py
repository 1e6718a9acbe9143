"""Sibling projections fused into one product for a single row (engine/fused.py), on the CPU.

Real MLX, the tiny demo model: a member's output is its own product's for one row and for
many; one row of a decode step makes one product per group (not one per member) and the
engine's greedy tokens stay mlx-lm's; the weights are held once (bytes measured); a weight
replaced after fusing is used (the member computes its own until :func:`fused.rebind`);
layers with biases are left alone.
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm import load  # noqa: E402

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine, fused, linear  # noqa: E402
from plimsoll.engine.drive import Blocks, drive, reference, seqs_for, sharpen, text  # noqa: E402


def _outputs(attn, mlp, xs) -> list[mx.array]:
    out = []
    for x in xs:
        out += [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), mlp.gate_proj(x),
                mlp.up_proj(x)]
    mx.eval(out)
    return out


def test_members_give_their_own_products_for_one_row_and_many(tmp_path):
    model, _ = load(str(build_demo_model(tmp_path, "tiny")))
    layer = model.model.layers[0]
    width = layer.self_attn.q_proj.weight.shape[1]
    xs = [mx.random.normal((1, 1, width), key=mx.random.key(1)),
          mx.random.normal((1, 5, width), key=mx.random.key(2)),
          mx.random.normal((3, 1, width), key=mx.random.key(3))]
    want = _outputs(layer.self_attn, layer.mlp, xs)
    linear.hold(model)
    assert fused.fuse(model) == 2 * len(model.model.layers)  # attention's and the MLP's
    assert type(layer.self_attn.q_proj).__name__ == "FusedHeldLinear"
    got = _outputs(layer.self_attn, layer.mlp, xs)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert mx.allclose(g, w, atol=1e-5, rtol=1e-5).item()


def test_one_row_makes_one_product_per_group(tmp_path, monkeypatch):
    eng = Engine.load(build_demo_model(tmp_path, "tiny"), block_tokens=16, max_blocks=64)
    sharpen(eng.model)
    layers = len(eng.model.model.layers)
    assert eng.fused_groups == 2 * layers and fused.fused_members(eng.model) == 5 * layers
    products = []
    real = fused.product

    def counted(x, t, t3):
        products.append(x.shape)
        return real(x, t, t3)

    monkeypatch.setattr(fused, "product", counted)
    prompt = text(eng.tokenizer, 30, salt=3)
    got = drive(eng, seqs_for([prompt], 6, 16, Blocks(64)), chunk=64)
    # the five decode steps: two fused products a layer (the prompt's chunk: none)
    assert len(products) == 5 * 2 * layers
    assert all(s[-2] == 1 for s in products)
    assert got == [reference(eng.model, prompt, 6)]


def test_the_weights_are_held_once(tmp_path):
    model, _ = load(str(build_demo_model(tmp_path, "tiny")))
    mx.eval(model.parameters())
    linear.hold(model)
    members = sum(v.nbytes for k, v in tree_flatten(model.parameters())
                  if any(f"{n}.weight" in k for names in fused.GROUPS for n in names))
    mx.synchronize()
    before = mx.get_active_memory()
    assert fused.fuse(model) > 0
    mx.synchronize()
    grown = mx.get_active_memory() - before
    assert members > 0 and grown < 0.05 * members, (grown, members)


def test_a_replaced_weight_is_used_and_rebind_fuses_it_again(tmp_path):
    model, _ = load(str(build_demo_model(tmp_path, "tiny")))
    linear.hold(model)
    fused.fuse(model)
    attn = model.model.layers[0].self_attn
    x = mx.random.normal((1, 1, attn.q_proj.weight.shape[1]), key=mx.random.key(4))
    attn.k_proj.weight = attn.k_proj.weight * 2
    group = attn.q_proj.__dict__[fused._GROUP][0]
    assert not group.bound()
    want = x @ attn.k_proj.weight.T
    assert mx.allclose(attn.k_proj(x), want, atol=1e-5).item()
    assert fused.rebind(model) == 1 and group.bound()
    assert mx.allclose(attn.k_proj(x), want, atol=1e-5).item()


def test_layers_with_biases_are_left_alone():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(8, 8, bias=True)
            self.k_proj = nn.Linear(8, 4, bias=True)
            self.v_proj = nn.Linear(8, 4, bias=True)

    module = Attention()
    linear.hold(module)
    assert fused.fuse(module) == 0 and fused.fused_members(module) == 0


def test_quantized_members_give_their_own_products(tmp_path):
    model, _ = load(str(build_demo_model(tmp_path, "tiny")))
    nn.quantize(model, group_size=32, bits=4)
    layer = model.model.layers[0]
    width = layer.self_attn.q_proj.scales.shape[1] * 32
    xs = [mx.random.normal((1, 1, width), key=mx.random.key(5)),
          mx.random.normal((1, 4, width), key=mx.random.key(6))]
    want = _outputs(layer.self_attn, layer.mlp, xs)
    linear.hold(model)
    assert fused.fuse(model) == 2 * len(model.model.layers)
    assert type(layer.mlp.up_proj).__name__ == "FusedQuantizedLinear"
    got = _outputs(layer.self_attn, layer.mlp, xs)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and mx.allclose(g, w, atol=1e-4, rtol=1e-4).item()
    members = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    assert fused.unfuse(model) == 5 * len(model.model.layers)
    assert all(type(m) is nn.QuantizedLinear for m in members)
    assert mx.allclose(layer.self_attn.k_proj(xs[0]), want[1], atol=1e-4).item()


def test_a_group_over_the_load_copy_bound_is_left_alone(tmp_path, monkeypatch):
    model, _ = load(str(build_demo_model(tmp_path, "tiny")))
    linear.hold(model)
    layer = model.model.layers[0]
    attn = sum(getattr(layer.self_attn, n).weight.nbytes for n in fused.GROUPS[0])
    mlp = sum(getattr(layer.mlp, n).weight.nbytes for n in fused.GROUPS[1])
    monkeypatch.setattr(fused, "MOST_BYTES", min(attn, mlp) - 1)
    assert fused.fuse(model) == 0  # each group one byte or more over
    monkeypatch.setattr(fused, "MOST_BYTES", max(attn, mlp))
    assert fused.fuse(model) == 2 * len(model.model.layers)
