"""``plimsoll verify`` for real: fault kinds injected into a guarded tiny worker (root only),
and mlx_lm.server driven under the same limit for the contrast."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from conftest import OPENBLAS

from plimsoll.guard import cgroups
from plimsoll.reliability.verify import Sample, Sampler, run_verify, summary, write_report
from plimsoll.reliability.verify.probe import DarwinProbe, LinuxProbe, probe_for
from plimsoll.reliability.verify.target import Prompts, filesystem_of

DARWIN = Path(__file__).parents[1] / "fixtures" / "darwin" / "m2_max_96g_limited_warn"


def _root_with_cgroups() -> None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("verify's cgroup guard needs Linux and root")
    if reason := cgroups.unavailable_reason():
        pytest.skip(reason)


def _say(message: str) -> None:
    """Progress with timestamps, shown by pytest when a test fails (or with -s)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _env() -> dict[str, str]:
    return {"LD_PRELOAD": OPENBLAS} if os.path.exists(OPENBLAS) else {}


# --- pure parts ---------------------------------------------------------------------------
@pytest.mark.pure
def test_sampler_window_reports_deltas_and_peaks() -> None:
    s = Sampler(LinuxProbe(os.getpid()))
    s.samples = [Sample(0.5, 5, 50, 40, 0, 0, 4, 0.0),
                 Sample(1.0, 10, 100, 90, 0, 0, 5, 0.0), Sample(2.0, 30, 300, 250, 2, 1, 9, 1.5),
                 Sample(3.0, 20, 200, 150, 3, 1, 9, None)]
    s.mlx = [(1.5, 700), (2.5, 900), (9.0, 5000)]
    w = s.window(1.0, 5.0)
    assert (w["peak_rss_bytes"], w["peak_usage_bytes"], w["peak_working_set_bytes"]) == (
        30, 300, 250)
    # deltas count from the last sample before the window: a counter that moved at its
    # very start is not lost
    assert (w["failcnt_delta"], w["oom_kill_delta"], w["pswpout_delta"]) == (3, 1, 5)
    assert w["pressure_max"] == 1.5
    assert w["mlx_active_peak_bytes"] == 900


@pytest.mark.pure
def test_the_probe_is_chosen_per_os_and_darwin_reads_recorded_outputs() -> None:
    assert isinstance(probe_for(1, None, "linux"), LinuxProbe)
    assert isinstance(probe_for(1, None, "darwin"), DarwinProbe)

    def run(argv):
        name = Path(argv[0]).name
        path = DARWIN / (f"sysctl_{argv[2]}.txt" if name == "sysctl" else f"{name}.txt")
        return path.read_text() if path.exists() else None

    probe = DarwinProbe(4242, run=run, footprint=lambda pid: pid * 1000)
    s = probe.sample()
    assert s.rss == s.usage == s.working_set == 4_242_000
    assert (s.failcnt, s.oom_kill) == (0, 0)  # no cgroup on macOS
    from plimsoll.probes import darwin

    vm = darwin.parse_vm_stat((DARWIN / "vm_stat.txt").read_text())
    assert s.pswpout == vm.pageouts + vm.swapouts
    level = (DARWIN / "sysctl_kern.memorystatus_vm_pressure_level.txt").read_text().strip()
    assert s.pressure == float(level)


def test_prompts_stay_within_their_token_count(tiny_model) -> None:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    p = Prompts(tiny_model, vocab)
    for n in (16, 256, 1000, 4096):
        c = p.count(p.text(n, 7))
        assert n * 0.9 <= c <= n
    assert p.text(256, 7) == p.text(256, 7) != p.text(256, 8)


@pytest.mark.pure
def test_filesystem_of_picks_the_longest_mount() -> None:
    info = ("22 1 8:1 / / rw - ext4 /dev/vda rw\n"
            "30 22 0:5 / /tmp rw - tmpfs tmpfs rw\n"
            "31 22 0:6 / /tmp\\040x rw - xfs /dev/b rw\n")
    assert filesystem_of(Path("/tmp/a/b"), info) == "tmpfs"
    assert filesystem_of(Path("/tmpfoo"), info) == "ext4"
    assert filesystem_of(Path("/tmp x/y"), info) == "xfs"


# --- for real -----------------------------------------------------------------------------
def test_verify_every_fault_kind_is_controlled(tiny_model, tmp_path, monkeypatch) -> None:
    _root_with_cgroups()
    monkeypatch.setenv("PLIMSOLL_CACHE", str(tmp_path / "cache"))
    limit = 768 << 20
    result = run_verify(tiny_model, limit_bytes=limit, concurrency=2, context=1024,
                        kinds=("long_prefill", "overload", "mlx_spike", "numpy_spike",
                               "mmap_prefetch", "load_spike", "together"),
                        env=_env(), contrast=False, mmap_bytes=limit * 5 // 4,
                        scratch_dir=tmp_path, report=_say)
    text = summary(result)
    assert result["passed"], text
    assert result["totals"]["oom_kills"] == 0 and result["totals"]["page_outs"] == 0
    assert result["worker"]["alive_at_end"]
    phases = {p["kind"]: p for p in result["phases"]}
    for kind in ("mlx_spike", "numpy_spike", "load_spike"):
        p = phases[kind]
        assert p["answers"].get("503 memory_trip", 0) >= 1, text
        f = p["figures"]
        assert f["soft_bytes"] < f["working_set_during"] < f["limit_bytes"], text
        assert f["peak_usage_bytes"] <= f["limit_bytes"]
    assert phases["load_spike"]["figures"]["copies"] >= 1
    # the prefetch filled the cgroup with page cache up to the hard line and the kernel
    # reclaimed it (fail count) instead of killing anyone; the worker kept answering
    mm = phases["mmap_prefetch"]
    assert mm["figures"]["helper_held"] and mm["figures"]["file_bytes"] > limit
    assert mm["figures"]["failcnt_delta"] > 0 and mm["figures"]["oom_kill_delta"] == 0
    assert set(mm["answers"]) <= {"200", "503 memory_trip"}
    together = phases["together"]["answers"]
    assert together.get("503 memory_trip", 0) + together.get("503 queue_full", 0) >= 1
    assert phases["overload"]["answers"].get("503 queue_full", 0) >= 1
    assert phases["long_prefill"]["answers"].get("400 context_length_exceeded") == 2
    assert result["contrast"] == {"ran": False, "reason": "turned off (--no-contrast)"}
    assert not list(tmp_path.glob("plimsoll-verify-*"))  # the scratch file is gone
    js, md = write_report(result, tmp_path / "out")
    assert json.loads(js.read_text())["passed"] is True
    assert "PASS" in md.read_text() and "| mmap_prefetch | pass |" in md.read_text()


def test_contrast_mlx_lm_server_under_the_same_limit(tiny_model, tmp_path, monkeypatch) -> None:
    """4 prompts of ~4× the context at once: plimsoll answers 400 at admission; mlx_lm.server
    prefills them together and its cgroup OOM-kills it (the host is untouched)."""
    _root_with_cgroups()
    from plimsoll.reliability.verify import contrast as verify_contrast

    if reason := verify_contrast.unavailable_reason():
        pytest.skip(reason)
    monkeypatch.setenv("PLIMSOLL_CACHE", str(tmp_path / "cache"))
    result = run_verify(tiny_model, limit_bytes=768 << 20, concurrency=4, context=1024,
                        kinds=("long_prefill",), env=_env(), contrast=True, report=_say)
    text = summary(result)
    assert result["passed"], text
    assert result["phases"][0]["answers"].get("400 context_length_exceeded") == 4
    c = result["contrast"]
    assert c["ran"] and c["cgroup_removed"] and c["limit_bytes"] == 768 << 20
    (p,) = c["phases"]
    assert p["kind"] == "long_prefill"
    assert c["oom_kills"] >= 1 and p["outcome"] == "OOM-killed", text
    assert p["figures"]["peak_usage_bytes"] >= (768 << 20) - (16 << 20)
    assert not Path(c["cgroup"]).exists()
    assert "| long_prefill | pass |" in text and "OOM-killed" in text
