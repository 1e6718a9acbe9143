"""The disk tier over the real paged engine and scheduler (tiny demo, CPU), driven step by step:
block payloads round-trip between engines, blocks evicted from memory come back from disk
into a later request's reservation (greedy output equal to mlx-lm's), a damaged file is
prefilled instead, the hybrid demo falls back to prefill."""

from __future__ import annotations

import numpy as np
import pytest
from test_worker_paged import BLOCK, Req, drain, load

from plimsoll.core.sizing import fixed_blocks
from plimsoll.demo.model import build_demo_model
from plimsoll.engine.block_io import export_block, import_block, supports
from plimsoll.engine.drive import reference, text
from plimsoll.engine.work import Step, Work
from plimsoll.worker.disk_restore import DiskTier, SpillingPool
from plimsoll.worker.events import SchedulerLimits
from plimsoll.worker.scheduler import Scheduler


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("disk") / "tiny", preset="tiny")


def disk_scheduler(eng, root, total=256, cap_blocks=None, disk_bytes=64 << 20):
    pool = SpillingPool(total=total, block_tokens=BLOCK,
                        cache_cap_blocks=total if cap_blocks is None else cap_blocks,
                        fixed_blocks_per_seq=fixed_blocks(eng.facts.per_sequence_fixed_bytes,
                                                          eng.block_bytes),
                        hybrid=eng.state_bytes_per_seq > 0, extra_key=b"test-model")
    limits = SchedulerLimits(max_num_seqs=1, max_queue=64, max_wait_s=600,
                             trip_bytes=1 << 62, max_batch=16, prefill_tokens=64)
    s = Scheduler(lambda stack: (eng, pool), limits, lambda: {})
    s.engine, s.pool = eng, pool
    s.eos_ids = set()
    s.disk = DiskTier.open(root, disk_bytes, eng, weights_hash="w", kv_dtype="float32")
    s.disk.attach(pool)
    return s


def test_a_block_round_trips_between_two_engines(tiny_dir):
    a, b = load(tiny_dir, 16), load(tiny_dir, 16)
    prompt = text(a.tokenizer, 2 * BLOCK, salt=1)
    a.run(Step(prefills=(Work(1, tuple(prompt), 0, (3, 5), True),)))
    data = export_block(a, 5)
    assert len(data) == a.block_bytes
    import_block(b, 9, data)
    assert export_block(b, 9) == data
    pa = next(k for k in a.layers if hasattr(k, "keys"))
    pb = next(k for k in b.layers if hasattr(k, "keys"))
    lo = slice(5 * BLOCK, 6 * BLOCK)
    assert np.array_equal(np.asarray(pa.keys[:, lo]), np.asarray(pb.keys[:, 9 * BLOCK:10 * BLOCK]))
    assert np.asarray(pb.keys[:, :9 * BLOCK]).sum() == 0  # only that block written
    with pytest.raises(ValueError):
        import_block(b, 1, data[:-4])


def test_blocks_spilled_at_shutdown_are_restored_into_a_new_engine(tiny_dir, tmp_path):
    eng = load(tiny_dir, 256)
    s = disk_scheduler(eng, tmp_path)
    prompt = text(eng.tokenizer, 12 * BLOCK + 7, salt=2)
    first = Req(s, prompt, 6)
    drain(s)
    s.disk.store.flush()
    assert s.disk.store.files >= 12  # written behind the finished request, before any stop
    assert s.pool.cached >= 12  # and still cached in memory
    assert s.disk.spill_all(s.pool) >= 12
    written = s.disk.stats()["files_written"]
    assert written >= 12 and s.pool.cached == 0
    s.disk.close()

    eng2 = load(tiny_dir, 256)  # a new engine: nothing in memory
    s2 = disk_scheduler(eng2, tmp_path)
    longer = prompt + first.tokens + text(eng.tokenizer, 9, salt=77)
    second = Req(s2, longer, 8)
    drain(s2)
    assert second.started.cached_tokens >= 0.9 * len(prompt)
    assert second.tokens == reference(eng2.model, longer, 8)
    d = s2.stats["disk"]
    assert d["hits"] >= 12 and d["restored_blocks"] >= 12 and d["bytes_read"] > 0
    assert s2.stats["prefill_tokens_computed"] == len(longer) - second.started.cached_tokens
    s2.disk.close()


def test_blocks_evicted_under_pressure_come_back_from_disk(tiny_dir, tmp_path):
    eng = load(tiny_dir, 24)
    s = disk_scheduler(eng, tmp_path, total=24)
    prompts = [text(eng.tokenizer, 5 * BLOCK + 2, salt=k) for k in (100, 200, 300, 400, 500, 600)]
    for p in prompts:
        Req(s, p, 8)
        drain(s)
    assert s.pool.counters["evicted_blocks"] > 0
    s.disk.store.flush()
    again = Req(s, prompts[0], 8)  # evicted from memory long ago
    drain(s)
    assert again.started.cached_tokens == 5 * BLOCK
    assert again.tokens == reference(eng.model, prompts[0], 8)
    assert s.stats["kv_bytes_peak"] <= 24 * eng.block_bytes
    s.disk.close()


def test_a_damaged_file_is_prefilled_instead(tiny_dir, tmp_path):
    eng = load(tiny_dir, 256)
    s = disk_scheduler(eng, tmp_path)
    prompt = text(eng.tokenizer, 8 * BLOCK + 3, salt=4)
    Req(s, prompt, 4)
    drain(s)
    s.disk.spill_all(s.pool)
    hashes = s.pool.prompt_hashes(prompt)
    path = s.disk.store.path(hashes[4])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x55
    path.write_bytes(bytes(data))
    again = Req(s, prompt, 6)
    drain(s)
    assert again.started.cached_tokens == 4 * BLOCK  # up to the damaged block
    assert again.tokens == reference(eng.model, prompt, 6)
    assert s.stats["disk"]["corrupt"] == 1
    s.disk.store.flush()  # deleted, prefilled, then written again behind the request: whole
    assert s.disk.store.get(hashes[4]) is not None
    s.disk.close()


def test_hybrid_models_fall_back_to_prefill(tmp_path_factory, tmp_path):
    hybrid = build_demo_model(tmp_path_factory.mktemp("disk") / "hybrid", preset="hybrid")
    eng = load(hybrid, 256)
    assert "hybrid" in supports(eng)
    s = disk_scheduler(eng, tmp_path)
    prompt = text(eng.tokenizer, 4 * BLOCK + 3, salt=6)
    first = Req(s, prompt, 4)
    drain(s)
    assert s.disk.spill_all(s.pool) == 0
    d = s.stats["disk"]
    assert d["state"] == "off" and "hybrid" in d["reason"] and d["files"] == 0
    s.disk.close()
    s2 = disk_scheduler(load(hybrid, 256), tmp_path)  # a restart: nothing came from disk
    again = Req(s2, prompt, 4)
    drain(s2)
    assert again.started.cached_tokens == 0 and again.tokens == first.tokens
    assert s2.stats["disk"]["hits"] == 0
    s2.disk.close()
