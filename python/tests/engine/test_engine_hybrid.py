"""The paged engine on a hybrid model (qwen3_next: gated-delta state + full attention).

Real mlx-lm inference on the ``hybrid`` demo preset (float32, CPU): recurrent state is
held per sequence and stacked for batched decodes; a shared prefix of blocks is
reusable where a state snapshot exists for it.
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine.drive import Blocks, drive, reference, seqs_for, text  # noqa: E402
from plimsoll.engine.work import Step, Work  # noqa: E402

BLOCK = 16
POOL = 64


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Engine:
    return Engine.load(build_demo_model(tmp_path_factory.mktemp("hybrid"), "hybrid"),
                       block_tokens=BLOCK, max_blocks=POOL)


def test_state_layers_follow_mlx_lm_cache(hybrid):
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(hybrid.model)
    kinds = [k.kind for k in hybrid.layers]
    assert kinds == ["state" if type(c).__name__ == "ArraysCache" else "full" for c in caches]
    assert [k.slots for k in hybrid.layers if k.kind == "state"] == \
        [len(c.cache) for c in caches if type(c).__name__ == "ArraysCache"]
    assert hybrid.state_bytes_per_seq > 0
    assert hybrid.block_bytes == 2 * BLOCK * hybrid.facts.kv_layers * \
        hybrid.facts.num_key_value_heads * hybrid.facts.head_dim * 4


@pytest.mark.parametrize("pipelined", [False, True])
def test_batched_chunked_greedy_equals_mlx_lm(hybrid, pipelined):
    prompts = [text(hybrid.tokenizer, n, salt=n) for n in (12, 45, 80)]
    want = [reference(hybrid.model, p, 8) for p in prompts]
    seqs = seqs_for(prompts, 8, BLOCK, Blocks(POOL, shuffle=True))
    assert drive(hybrid, seqs, chunk=20, pipelined=pipelined) == want
    assert hybrid.state_bytes_held() == 0  # drive freed every sequence


def test_live_state_is_one_per_sequence(hybrid):
    prompts = [text(hybrid.tokenizer, n, salt=n) for n in (10, 30)]
    tables = [(0, 1), (2, 3)]
    for i, p in enumerate(prompts):
        hybrid.run(Step(prefills=(Work(i, tuple(p), 0, tables[i], True),)))
    hybrid.run(Step(decodes=tuple(Work(i, None, len(p), tables[i], True)
                                  for i, p in enumerate(prompts))))
    assert hybrid.state_bytes_held() == 2 * hybrid.state_bytes_per_seq
    hybrid.free_state(0)
    hybrid.free_state(1)
    assert hybrid.state_bytes_held() == 0


def test_prefix_reuse_through_a_state_snapshot(hybrid):
    base = text(hybrid.tokenizer, 2 * BLOCK, salt=21)
    prompts = [base + text(hybrid.tokenizer, n, salt=s) for n, s in ((9, 70), (14, 80))]
    want = [reference(hybrid.model, p, 6) for p in prompts]
    blocks = Blocks(POOL)
    a = seqs_for(prompts[:1], 6, BLOCK, blocks)
    # the prefix (two full blocks) as its own chunk, then a snapshot of the state after it
    hybrid.run(Step(prefills=(Work(0, tuple(base), 0, a[0].table, False),)))
    hybrid.snapshot_state(0, "base")
    a[0].written = len(base)
    assert drive(hybrid, a, chunk=64) == want[:1]
    assert hybrid.state_bytes_held() == hybrid.state_bytes_per_seq  # the snapshot only
    b = seqs_for(prompts[1:], 6, BLOCK, blocks, shared={0: a[0].table[:2]})
    hybrid.restore_state("base", 0)
    b[0].written = len(base)
    assert drive(hybrid, b, chunk=64) == want[1:]
    hybrid.drop_snapshot("base")
    assert hybrid.state_bytes_held() == 0


@pytest.mark.parametrize("family", ["lfm2", "olmo_hybrid"])
def test_state_of_any_slot_count_equals_mlx_lm(family_dir, family):
    """lfm2 (a 1-array conv state) and olmo_hybrid (4 arrays): the slot count is read from
    mlx-lm's own cache, batched, pipelined, chunked, scattered blocks."""
    eng = Engine.load(family_dir(family), block_tokens=BLOCK, max_blocks=POOL)
    slots = {k.slots for k in eng.layers if k.kind == "state"}
    assert slots == {"lfm2": {1}, "olmo_hybrid": {4}}[family]
    prompts = [[(7 * i + 3 * n) % 500 + 1 for i in range(n)] for n in (9, 30, 45)]
    want = [reference(eng.model, p, 6) for p in prompts]
    assert len({tuple(w) for w in want}) > 1
    seqs = seqs_for(prompts, 6, BLOCK, Blocks(POOL, shuffle=True))
    assert drive(eng, seqs, chunk=16, pipelined=True) == want
