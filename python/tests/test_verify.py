"""``plimsoll verify`` for real: fault kinds injected into a guarded tiny worker (root only)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import OPENBLAS

from plimsoll import cgroups
from plimsoll.verify import Sample, Sampler, run_verify, summary, write_report


def test_sampler_window_reports_deltas_and_peaks() -> None:
    s = Sampler(os.getpid(), None)
    s.samples = [Sample(1.0, 10, 100, 90, 0, 0, 5, 0.0), Sample(2.0, 30, 300, 250, 2, 1, 9, 1.5),
                 Sample(3.0, 20, 200, 150, 3, 1, 9, None)]
    w = s.window(0.0, 5.0)
    assert (w["peak_rss_bytes"], w["peak_usage_bytes"], w["peak_working_set_bytes"]) == (
        30, 300, 250)
    assert (w["failcnt_delta"], w["oom_kill_delta"], w["pswpout_delta"]) == (3, 1, 4)
    assert w["psi_some_avg10_max"] == 1.5


def test_verify_spikes_overload_and_prefill_are_controlled(tiny_model, tmp_path,
                                                           monkeypatch) -> None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("verify's cgroup guard needs Linux and root")
    if reason := cgroups.unavailable_reason():
        pytest.skip(reason)
    monkeypatch.setenv("PLIMSOLL_CACHE", str(tmp_path / "cache"))
    env = {"LD_PRELOAD": OPENBLAS} if os.path.exists(OPENBLAS) else {}
    result = run_verify(tiny_model, limit_bytes=768 << 20, concurrency=2, context=1024,
                        kinds=("long_prefill", "overload", "mlx_spike", "numpy_spike"),
                        env=env)
    text = summary(result)
    assert result["passed"], text
    assert result["totals"]["oom_kills"] == 0 and result["totals"]["page_outs"] == 0
    assert result["worker"]["alive_at_end"]
    phases = {p["kind"]: p for p in result["phases"]}
    for kind in ("mlx_spike", "numpy_spike"):
        p = phases[kind]
        assert p["answers"].get("503 memory_trip", 0) >= 1
        f = p["figures"]
        assert f["soft_bytes"] < f["working_set_during"] < f["limit_bytes"]
        assert f["peak_usage_bytes"] <= f["limit_bytes"]
    assert phases["overload"]["answers"].get("503 queue_full", 0) >= 1
    assert phases["long_prefill"]["answers"].get("400 context_length_exceeded") == 1
    js, txt = write_report(result, tmp_path / "out")
    assert json.loads(js.read_text())["passed"] is True
    assert "PASS" in txt.read_text()
