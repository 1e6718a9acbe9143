"""Measured-peak calibration: a real worker run on the tiny demo model feeds admission."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import OPENBLAS

from plimsoll.core.units import GIB
from plimsoll.launch import calibration as C
from plimsoll.launch import live_admission as LA
from plimsoll.probes import read_snapshot
from plimsoll.reliability.calibrate import calibrate

pytestmark = pytest.mark.pure

# A small budget keeps the pool (and the test) small; the reserve fraction then matters.
OVERRIDES = LA.MemoryOverrides(budget_gib=1.0, ceiling_mib=8192, total_ram_gib=8.0)


def figures() -> LA.MemoryFigures:
    return LA.memory_figures(None, "standalone", OVERRIDES, read_snapshot)


def test_weights_hash_reads_headers_only_and_tracks_them(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    f = tmp_path / "model.safetensors"
    f.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    first = C.weights_hash(tmp_path)
    f.write_bytes(len(header).to_bytes(8, "little") + header + b"\1" * 8)  # values only
    assert C.weights_hash(tmp_path) == first
    header2 = header.replace(b"[2]", b"[1]")
    f.write_bytes(len(header2).to_bytes(8, "little") + header2 + b"\0" * 8)
    assert C.weights_hash(tmp_path) != first
    with pytest.raises(FileNotFoundError):
        C.weights_hash(tmp_path / "nowhere")


def test_measurement_counts_unknown_as_reserve() -> None:
    # the largest figure is the peak; everything above weights and KV held is reserve
    assert C.Measurement.derive(100, 50, 120, 400, 300) == (400, 250)
    assert C.Measurement.derive(100, 50, 120, 90, None) == (120, 0)


def test_reserve_fraction_only_raises() -> None:
    cal = C.Calibration(reserve_bytes=GIB // 4, peak_bytes=GIB, covers=True, runs=1, path="x")
    assert C.reserve_fraction(0.05, None, GIB) == 0.05
    assert C.reserve_fraction(0.05, cal, GIB) == 0.25
    assert C.reserve_fraction(0.5, cal, GIB) == 0.5
    assert C.reserve_fraction(0.05, cal, GIB // 8) == 1.0


@pytest.mark.impure
def test_calibrate_the_tiny_model_then_admission_uses_it(tiny_model, tmp_path,
                                                         monkeypatch) -> None:
    monkeypatch.setenv("PLIMSOLL_CACHE", str(tmp_path))
    env = {"LD_PRELOAD": OPENBLAS} if os.path.exists(OPENBLAS) else {}
    wanted = LA.Wanted(concurrency=2, context=1024)
    _, req0, before = LA.plan(tiny_model, None, None, figures(), wanted)
    assert C.lookup(tiny_model, "float32", 2, 1024) is None

    lines: list[str] = []
    path, m = calibrate(tiny_model, concurrency=2, context=1024, report=lines.append,
                          figures=figures(), env=env)
    assert path.is_relative_to(tmp_path / "calibration")
    assert any("first inference" in line for line in lines)  # progress was reported
    assert m.requests_ok == 2 and m.concurrency == 2 and m.context == 1024
    assert m.prompt_tokens == 1024 - 16
    assert m.kv_bytes_peak >= 2 * 1008 * 2048  # two full prompts' KV was really held
    assert m.peak_bytes == max(m.mlx_peak_bytes, m.rss_hwm_bytes, m.cgroup_max_usage_bytes or 0)
    assert m.reserve_bytes == m.peak_bytes - m.weights_bytes - m.kv_bytes_peak > 0
    doc = json.loads(path.read_text())
    assert doc["kv_dtype"] == "float32" and "mlx=" in doc["engine"]
    assert doc["weights_hash"] == C.weights_hash(tiny_model)

    cal = C.lookup(tiny_model, "float32", 2, 1024)
    assert cal is not None and cal.covers and cal.reserve_bytes == m.reserve_bytes
    assert not C.lookup(tiny_model, "float32", 4, 1024).covers  # an extrapolation, flagged

    _, req, after = LA.plan(tiny_model, None, None, figures(), wanted)
    budget = figures().budget_bytes
    assert req.transient_reserve == max(req0.transient_reserve, m.reserve_bytes / budget)
    assert after.transient_reserve_bytes >= min(m.reserve_bytes, budget) - 1
    assert after.footprint_bytes >= m.peak_bytes  # max(formula, measured)
    if m.reserve_bytes > before.transient_reserve_bytes:
        assert after.pool_blocks < before.pool_blocks  # the unknown came out of the pool
    # opting out gives the formula back
    _, _, formula = LA.plan(tiny_model, None, None, figures(), wanted, calibrated=False)
    assert formula == before
