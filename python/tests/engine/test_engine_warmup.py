"""The load-time warm-up (engine/warmup.py) leaves nothing behind: real engine, CPU.

It runs only on GPU backends by default; ``force=True`` runs the same steps here. After it
the engine holds no recurrent state, and batched greedy output still equals mlx-lm's.
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine.drive import Blocks, drive, reference, seqs_for, sharpen, text  # noqa: E402
from plimsoll.engine.warmup import warm_up  # noqa: E402


@pytest.mark.parametrize("preset", ["tiny", "hybrid"])
def test_warm_up_leaves_no_state_and_output_unchanged(tmp_path, preset):
    eng = Engine.load(build_demo_model(tmp_path, preset), block_tokens=16, max_blocks=64)
    sharpen(eng.model)
    assert warm_up(eng) == 0.0  # the CPU backend compiles nothing: skipped
    assert eng.fused_prefill is False  # and materialises attention scores
    assert warm_up(eng, 64, force=True) > 0
    assert eng.state_bytes_held() == 0 and eng.blocks_allocated() > 0
    prompts = [text(eng.tokenizer, 40, salt=s) for s in (1, 2)]
    want = [reference(eng.model, p, 8) for p in prompts]
    # the warm-up wrote the pool's first blocks: the sequences reuse them
    got = drive(eng, seqs_for(prompts, 8, 16, Blocks(64)), chunk=32, pipelined=True)
    assert got == want
