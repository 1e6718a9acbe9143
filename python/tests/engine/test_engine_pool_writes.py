"""Pool writes are in place: a step's MLX peak does not follow the allocated pool's size.

Real engine on the tiny demo model (CPU, float32, 4 layers): the same steps over a pool of
64 MiB and one of 512 MiB, every block allocated up front. A write that copied a layer's K
or V array would put a whole array (8 MiB, 64 MiB) on the peak; MLX's peak over the steps,
above the memory active before them, must instead be the same small figure for both pools,
with pipelining on (step n + 1 submitted before step n's tokens are read, its decodes fed
the lazy tokens) and off, for decode steps and for steps that mix decodes with a chunk at a
prefix offset (several writes into one layer's pool in one forward: engine/forward.py).
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from plimsoll.demo.model import build_demo_model  # noqa: E402
from plimsoll.engine import Engine  # noqa: E402
from plimsoll.engine.work import Step, Work  # noqa: E402

MIB = 1 << 20
BLOCK = 16
ROWS, PROMPT, CHUNK = 4, 199, 32


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("tiny"), "tiny")


def step_peak(model_dir, pool_mib: int, pipelined: bool, mixed: bool,
              hold: bool = False) -> int:
    """MLX's peak over four steps (after two) above the memory active before them, in bytes.
    ``hold``: keep a pending read of every pool array before them (the control: each first
    write must then copy its array)."""
    probe = Engine.load(model_dir, block_tokens=BLOCK, max_blocks=1)
    blocks = pool_mib * MIB // probe.block_bytes
    del probe
    eng = Engine.load(model_dir, block_tokens=BLOCK, max_blocks=blocks, slab_blocks=blocks,
                      pipeline=pipelined)
    tables = [tuple(range(20 * i + 7, 20 * i + 27)) for i in range(ROWS)]  # scattered ids
    for i, table in enumerate(tables):
        eng.run(Step(prefills=(Work(i, tuple(range(1, PROMPT + 1)), 0, table, True),)))
    chunk_table = tuple(range(200, 240))
    eng.run(Step(prefills=(Work(ROWS, tuple(range(3, 300)), 0, chunk_table, False),)))
    mx.synchronize()
    assert eng.kv_bytes_allocated() == blocks * eng.block_bytes  # the whole pool exists
    pending, held = None, []
    for k in range(6):
        if k == 2:  # steady state: measure from here
            pending.result()
            mx.synchronize()
            # (a lazy read of each array as it is now: an unevaluated op holding the version)
            held = [a[:, :1] for p in eng._pools for a in (p.keys, p.values)] if hold else []
            before = mx.get_active_memory()
            mx.reset_peak_memory()
        decodes = tuple(Work(i, None, PROMPT + k, t, True) for i, t in enumerate(tables))
        chunk = (Work(ROWS, tuple(range(5, 5 + CHUNK)), 297 + CHUNK * k, chunk_table, True),)
        nxt = eng.run_async(Step(decodes=decodes, prefills=chunk if mixed else ()))
        if pending is not None:
            pending.result()
        pending = nxt
    pending.result()
    mx.synchronize()
    del held
    return mx.get_peak_memory() - before


@pytest.mark.parametrize("mixed", [False, True], ids=["decodes", "decodes+chunk"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
def test_the_peak_does_not_grow_with_the_pool(tiny_dir, pipelined, mixed):
    small = step_peak(tiny_dir, 64, pipelined, mixed)
    large = step_peak(tiny_dir, 512, pipelined, mixed)
    one_array = 64 * MIB // (2 * 4)  # one layer's K (or V) of the smaller pool: 8 MiB
    # a copy of one array would add 8 MiB (64 MiB for the large pool); the steps' own
    # transient is under 1 MiB (the measure's noise: buffers freed meanwhile, ± 1 MiB)
    assert small < one_array // 4 and large < one_array // 4, (small, large)


def test_the_measure_sees_a_copy(tiny_dir):
    """Control: with the old pool arrays still held by a pending read, the writes must copy,
    and the same measure shows it (at least one layer's array of the 512 MiB pool)."""
    assert step_peak(tiny_dir, 512, False, True, hold=True) >= 512 * MIB // (2 * 4)


def test_a_step_of_several_groups_writes_each_layer_once(tiny_dir, monkeypatch):
    """Decode rows, a chunk at a prefix and a first chunk in one forward: each layer's pool
    takes one write (engine/mixers.write_once), before any group reads it: on MLX's CUDA
    backend a write after a read still in flight copies the layer's whole array."""
    from plimsoll.engine.paged import FullAttention

    eng = Engine.load(tiny_dir, block_tokens=BLOCK, max_blocks=64)
    assert eng.mixers.ok
    t0, t1, t2 = tuple(range(0, 4)), tuple(range(4, 8)), tuple(range(8, 12))
    prompt = tuple(range(3, 43))
    for seq, table in ((0, t0), (1, t1)):
        eng.run(Step(prefills=(Work(seq, prompt, 0, table, True),)))
    writes: list = []
    real = FullAttention.write

    def counted(self, *args):
        writes.append(self)
        return real(self, *args)

    monkeypatch.setattr(FullAttention, "write", counted)
    eng.run(Step(decodes=(Work(0, None, len(prompt), t0, True),),
                 prefills=(Work(1, tuple(range(7, 17)), len(prompt), t1, True),
                           Work(2, prompt[:20], 0, t2, True))))
    assert sorted(map(id, writes)) == sorted(map(id, eng._pools)), len(writes)


def test_a_decode_row_is_written_as_a_view_not_gathered_each_layer(tiny_dir, tmp_path):
    """A one-row step's new K/V go to the pools as views of the model's arrays: the graph
    the host builds and the backend encodes has no per-layer gather for them (``a[0]`` of a
    (1, heads, 1, dim) array was a Gather and a copy for K and for V in every layer)."""
    eng = Engine.load(tiny_dir, block_tokens=BLOCK, max_blocks=64)
    table = tuple(range(16))
    first = eng.run(Step(prefills=(Work(0, tuple(range(5, 5 + PROMPT)), 0, table, True),)))
    graphs = []
    submit = mx.async_eval

    def capture(arrays):
        path = tmp_path / f"{len(graphs)}.dot"
        mx.export_to_dot(str(path), *[a for a in arrays if isinstance(a, mx.array)])
        graphs.append(path.read_text())
        return submit(arrays)

    mx.async_eval = capture
    try:
        eng.run(Step(decodes=(Work(0, (first[0],), PROMPT, table, True),)))
    finally:
        mx.async_eval = submit
    layers = len(eng.layers)
    assert layers >= 2 and graphs
    assert graphs[-1].count('label ="Gather"') < layers  # was 2 a layer and 1
    assert graphs[-1].count('label ="SliceUpdate"') == 2 * layers  # each layer's K and V
