"""One source for every pool figure: admission, launch, the worker and the proxy agree.

The contract property: every admitted or clamped decision yields a worker configuration
whose own start-up check passes (the worker's ``make_pool``) and whose pool holds
``concurrency`` full-context sequences at once (the worker's own block pool, asked). Plus
the bugs of issue 14: the worker that refused a pool of exactly one sequence, the KV dtype
(passed to the worker, verified by launch in bytes), and the default budget in a cgroup."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import free_port, worker_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plimsoll.core.admission import AdmissionRequest, admit
from plimsoll.core.model_facts import facts_from_config
from plimsoll.core.sizing import blocks_for, pool_for, pool_problem, right_size
from plimsoll.core.units import GIB, KIB, MIB
from plimsoll.demo.model import PRESETS
from plimsoll.launch.spawn import mismatches, worker_config
from plimsoll.probes.snapshot import MemorySnapshot
from plimsoll.worker.backend import make_pool
from plimsoll.worker.pool import BlockPool, Grant

pytestmark = pytest.mark.pure

FACTS = facts_from_config({**PRESETS["tiny"], "torch_dtype": "float32"}, 10 * MIB)


def engine_for(decision, fixed_bytes: int) -> SimpleNamespace:
    """What make_pool reads of a loaded engine: its real block bytes and facts."""
    facts = SimpleNamespace(per_sequence_fixed_bytes=fixed_bytes, kv_dtype="float32",
                            kv_format="float32", fixed_bytes=lambda context: fixed_bytes)
    return SimpleNamespace(facts=facts, block_bytes=decision.block_bytes,
                           state_bytes_per_seq=fixed_bytes)


def holds(pool: BlockPool, concurrency: int, context: int, max_tokens: int) -> bool:
    """Whether ``concurrency`` sequences of the whole context are admitted at once."""
    for i in range(concurrency):
        prompt = [i * 7919 + j for j in range(context - max_tokens)]  # distinct: no sharing
        grant = pool.can_allocate(prompt, max_tokens)
        if not isinstance(grant, Grant):
            return False
        pool.allocate(i, grant)
        assert pool.grow(i, context) is not None
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget_mib=st.integers(64, 64 * 1024), weights_mib=st.integers(1, 8 * 1024),
       kv_kib=st.sampled_from([4, 16, 36, 96, 112, 144]),
       fixed_kib=st.sampled_from([0, 0, 100, 3000]),
       block=st.sampled_from([16, 32, 64]), concurrency=st.integers(1, 16),
       context=st.integers(512, 16384), max_tokens=st.integers(1, 511),
       min_context=st.sampled_from([512, 2048]))
def test_every_admitted_decision_starts_and_holds_its_sequences(
        budget_mib, weights_mib, kv_kib, fixed_kib, block, concurrency, context, max_tokens,
        min_context):
    req = AdmissionRequest(
        ceiling_bytes=budget_mib * MIB, total_ram_bytes=budget_mib * MIB,
        budget_bytes=budget_mib * MIB, weights_bytes=weights_mib * MIB,
        kv_bytes_per_token=kv_kib * KIB, per_sequence_fixed_bytes=fixed_kib * KIB,
        transient_reserve=0.05, block_tokens=block, concurrency=concurrency,
        context=context, max_tokens=max_tokens, min_context=min_context)
    d = admit(req)
    if not d.admitted:
        return
    for dec in (d, right_size(d)):  # launch's pool and the proxy's right-sized one
        cfg = worker_config(Path("/m"), "m", FACTS, dec, None, None, port=1)
        assert cfg.max_cache_blocks == dec.pool_blocks and cfg.block_bytes == d.block_bytes
        pool = make_pool(cfg, engine_for(dec, fixed_kib * KIB))  # raises SystemExit if not
        assert pool.fixed_blocks_per_seq == dec.fixed_blocks_per_seq
        assert holds(pool, dec.concurrency, dec.context, dec.output_reservation)
        assert pool_problem(cfg.max_cache_blocks, cfg.context, cfg.block_tokens,
                            dec.fixed_blocks_per_seq, cfg.max_num_seqs) is None


def test_figures_are_one_function():
    assert blocks_for(1024, 64) == 16 and blocks_for(1025, 64, 2) == 19
    assert pool_for(3, 1024, 64, 1) == 51
    assert pool_problem(16, 1024, 64, 0) is None  # exactly one sequence: no headroom
    msg = pool_problem(15, 1024, 64, 0)
    assert "raise the pool to 16 blocks" in msg and "lower the context to 960" in msg


def test_clamped_context_is_exactly_what_the_worker_accepts():
    """Issue 14: 2 × 16384 clamped to 1 × 16288 in an 8 GiB cgroup; the worker then refused
    its own pool for want of a move headroom admission never counted."""
    d = admit(AdmissionRequest(
        ceiling_bytes=8 * GIB, total_ram_bytes=8 * GIB, budget_bytes=8 * GIB,
        weights_bytes=int(2.4e9), kv_bytes_per_token=224 * KIB, transient_reserve=0.25,
        block_tokens=16, concurrency=2, context=16384, max_tokens=256))
    assert d.decision == "clamp" and d.concurrency == 1 and d.context < 16384
    assert pool_problem(d.pool_blocks, d.context, 16, d.fixed_blocks_per_seq) is None


def test_launch_compares_block_bytes_not_only_counts():
    d = admit(AdmissionRequest(ceiling_bytes=8 * GIB, total_ram_bytes=8 * GIB,
                               budget_bytes=8 * GIB, weights_bytes=GIB,
                               kv_bytes_per_token=64 * KIB, transient_reserve=0.05,
                               block_tokens=16, concurrency=1, context=4096, max_tokens=256))
    cfg = worker_config(Path("/m"), "m", FACTS, d, None, None, port=1)
    good = {"pool": {"total": cfg.max_cache_blocks}, "block_bytes": d.block_bytes,
            "kv_bytes_bound": d.pool_blocks * d.block_bytes, "kv_dtype": "float32",
            "transient_bytes": cfg.transient_bytes,
            "limits": {"memory_limit_applied_bytes": cfg.allocation_limit_bytes,
                       "cache_limit_applied_bytes": cfg.mlx_cache_bytes,
                       "trip_bytes": cfg.trip_bytes},
            "context": {"configured": cfg.context}, "max_num_seqs": cfg.max_num_seqs}
    assert mismatches(cfg, good) == []
    half = good | {"block_bytes": d.block_bytes // 2,
                   "kv_bytes_bound": d.pool_blocks * d.block_bytes // 2, "kv_dtype": "float16"}
    bad = mismatches(cfg, half)
    assert any(b.startswith("block bytes") for b in bad) and any("kv dtype" in b for b in bad)


def _worker(model: Path, *flags: str) -> subprocess.Popen:
    port = free_port()
    argv = [sys.executable, "-m", "plimsoll.cli", "worker", "--model", str(model),
            "--gpu-memory-utilization", "0.9", "--ceiling-bytes", str(8 << 30),
            "--total-ram-bytes", str(16 << 30), "--port", str(port), *flags]
    proc = subprocess.Popen(argv, env=worker_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc.port = port
    return proc


def _status(proc: subprocess.Popen, timeout: float = 120.0) -> dict | None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return httpx.get(f"http://127.0.0.1:{proc.port}/v1/plimsoll/status", timeout=2).json()
        except httpx.HTTPError:
            time.sleep(0.2)
    return None


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.terminate()
    out, _ = proc.communicate(timeout=30)
    return out


@pytest.mark.impure
def test_a_pool_of_exactly_one_sequence_starts_and_honours_the_kv_dtype(tiny_model):
    proc = _worker(tiny_model, "--max-cache-blocks", "16", "--context", "1024",
                   "--block-tokens", "64", "--max-num-seqs", "1", "--max-tokens", "64")
    try:
        st32 = _status(proc)
        assert st32 is not None, _stop(proc)
        assert st32["pool"]["total"] == 16 and st32["kv_dtype"] == "float32"
        r = httpx.post(f"http://127.0.0.1:{proc.port}/v1/completions", timeout=120,
                       json={"prompt": "x " * 900, "max_tokens": 64, "temperature": 0})
        assert r.status_code == 200, r.text  # the whole context, in exactly the pool
    finally:
        _stop(proc)
    proc = _worker(tiny_model, "--max-cache-blocks", "16", "--context", "1024",
                   "--block-tokens", "64", "--max-num-seqs", "1", "--max-tokens", "64",
                   "--kv-dtype", "float16", "--block-bytes", str(st32["block_bytes"] // 2))
    try:
        st16 = _status(proc)
        assert st16 is not None, _stop(proc)
        assert st16["kv_dtype"] == "float16" and st16["block_bytes"] * 2 == st32["block_bytes"]
    finally:
        _stop(proc)
    # a worker whose real blocks differ from what admission counted refuses to start
    proc = _worker(tiny_model, "--max-cache-blocks", "16", "--context", "1024",
                   "--block-tokens", "64", "--max-num-seqs", "1", "--max-tokens", "64",
                   "--block-bytes", str(st32["block_bytes"] // 2))
    out = _stop(proc) if _status(proc, 60) is not None else proc.communicate(timeout=60)[0]
    assert proc.returncode != 0 and "--block-bytes" in out and "--kv-dtype" in out


# --- the default budget inside a memory cgroup ---------------------------------------------
def test_default_budget_in_a_cgroup_keeps_no_os_floor():
    from plimsoll.launch.defaults import default_policy

    def snap(source: str) -> MemorySnapshot:
        return MemorySnapshot(platform="linux", total_ram_bytes=4 * GIB, ceiling_bytes=4 * GIB,
                              ceiling_source=source, in_use_bytes=0,
                              process_footprint_bytes=0)

    inside = default_policy(snap("cgroup v1 memory.limit_in_bytes of /x"))
    assert inside.budget_bytes("standalone") == 4 * GIB
    host = default_policy(snap("MemTotal (no cgroup memory limit)"))
    assert host.budget_bytes("standalone") == 2 * GIB  # a bare 4 GiB host keeps its floor


def sparse_model(root: Path, preset: str = "qwen3-0.6b") -> Path:
    """A model directory admission can read (config + safetensors header), its weights a
    sparse file: admission reads headers only, so no weights are written or loaded."""
    from plimsoll.demo.model import model_config

    cfg = model_config(preset, "float32", {"<|endoftext|>": 0, "<|im_end|>": 1})
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg[
        "head_dim"]
    shapes = {"model.embed_tokens.weight": [cfg["vocab_size"], h], "model.norm.weight": [h]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": [q, h], p + "self_attn.k_proj.weight": [kv, h],
                   p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, q],
                   p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
                   p + "mlp.down_proj.weight": [h, inter],
                   p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]}
    header, off = {}, 0
    for name, shape in shapes.items():
        n = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    raw = json.dumps(header).encode()
    with (root / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    return root


@pytest.mark.impure
def test_a_4gib_cgroup_admits_the_qwen3_demo(tmp_path):
    from plimsoll.guard.process import WorkerGuard

    model = sparse_model(tmp_path / "qwen3-0.6b")
    guard, why = WorkerGuard.create("admit-4g", 4 * GIB)
    if guard is None:
        pytest.skip(f"no memory cgroup: {why}")
    try:
        out = subprocess.run(guard.wrap([sys.executable, "-m", "plimsoll.cli", "admit",
                                         str(model), "--context", "4096", "--max-tokens",
                                         "256", "--json"]),
                             env=worker_env(), capture_output=True, text=True, timeout=120)
    finally:
        guard.close()
    assert out.returncode == 0, out.stdout + out.stderr
    d = json.loads(out.stdout)
    assert d["decision"] in ("admit", "clamp") and d["budget_bytes"] == 4 * GIB
    assert d["ceiling_bytes"] == 4 * GIB and "cgroup" in d["sources"]
    assert d["weights_bytes"] > 2 * GIB  # the real 0.6B shape in float32


# ------------------------------------------------ the prefill transient admission counts

@given(st.integers(0, 64 * GIB))
def test_the_reserve_for_a_compute_transient_holds_it(compute):
    from plimsoll.core.sizing import compute_transient_bytes, reserve_for_compute

    reserve = reserve_for_compute(compute)
    assert compute_transient_bytes(reserve) >= compute
    assert reserve <= max(2 * compute, compute + MIB)  # never more than twice (or 1 MiB)


@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 6000),
       st.sampled_from([1, 16, 64]))
def test_largest_fitting_is_the_last_fit(low, high, limit, step):
    from plimsoll.core.sizing import largest_fitting

    got = largest_fitting(low, high, lambda x: x <= limit, step)
    fitting = [x for x in range(low, high + 1) if x % step == 0 and x <= limit]
    assert got == (max(fitting) if fitting else None)


def _plan_tiny(context: int, budget_mib: int, concurrency: int = 4, max_tokens: int = 1024):
    from plimsoll.core.admission import admit_counting_transient
    from plimsoll.core.transients import transient_floor

    req = AdmissionRequest(
        ceiling_bytes=48 * GIB, total_ram_bytes=64 * GIB, budget_bytes=budget_mib * MIB,
        weights_bytes=FACTS.weights_bytes, kv_bytes_per_token=FACTS.kv_bytes_per_token,
        native_max_context=40960, transient_reserve=0.05, block_tokens=16,
        concurrency=concurrency, context=context, max_tokens=max_tokens)
    return admit_counting_transient(FACTS, req), transient_floor


def test_a_long_context_takes_its_transient_from_the_pool_not_a_third_of_its_context():
    """The regression: the tiny demo at 4 × 32768 in a 512 MiB budget was clamped to 13088
    tokens because the gather of 32k tokens passed 5 % of the budget, while the pool had
    room to spare. Now the reserve holds the transient at 32k and the context stands (in a
    1 GiB budget since the transient counts every layer a paced step holds in flight)."""
    from plimsoll.core.sizing import compute_transient_bytes
    from plimsoll.core.transients import prefill_chunk, prefill_transient_bytes

    d, floor = _plan_tiny(32768, 1024)
    assert d.decision == "admit" and d.context == 32768 and d.concurrency == 4, d.reasons
    assert d.transient_reserve_bytes == floor(FACTS, 32768, 16) > 0.05 * 1024 * MIB
    assert d.footprint_bytes <= d.budget_bytes
    compute = compute_transient_bytes(d.transient_reserve_bytes)
    chunks = [prefill_chunk(FACTS, c, compute, block_tokens=16, most=512)
              for c in (1024, 8192, 32768)]
    assert chunks[0] >= chunks[1] >= chunks[2] >= 16, chunks  # the chunk follows the context
    for c, chunk in zip((1024, 8192, 32768), chunks, strict=True):
        assert prefill_transient_bytes(FACTS, chunk, c, 16) <= compute  # under one bound
    # the worker started from it accepts its context (its start-up check)
    cfg = worker_config(Path("/m"), "m", FACTS, right_size(d), None, None, port=1)
    assert cfg.transient_bytes == compute and cfg.context == 32768


def test_a_transient_the_envelope_cannot_hold_clamps_the_context_to_the_longest_that_fits():
    d, _ = _plan_tiny(32768, 64, concurrency=1, max_tokens=256)
    assert d.decision == "clamp" and 2048 <= d.context < 32768, d.reasons
    assert any("prefill transient at context 32768" in r for r in d.reasons)
    nxt, _ = _plan_tiny(d.context + 16, 64, concurrency=1, max_tokens=256)
    assert nxt.decision != "admit" or nxt.context < d.context + 16  # the longest that fits
    tiny, _ = _plan_tiny(32768, 20, concurrency=1, max_tokens=256)
    assert tiny.decision == "refuse"
