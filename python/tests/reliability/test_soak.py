"""``plimsoll verify --soak``: the pure parts (the load's shape, the policy, the verdict), then
a short real soak of ``plimsoll serve`` with two demo models under a memory cgroup."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from plimsoll.core.policy import parse_policy
from plimsoll.core.units import GIB, MIB
from plimsoll.reliability.soak.load import Shape, error_code, new_session, shared_prompt
from plimsoll.reliability.soak.report import build, markdown, verdict
from plimsoll.reliability.soak.run import Soak, proxy_events, soak_policy


def test_the_shape_cycles_levels_and_pauses_for_idle_gaps():
    shape = Shape(levels=(2, 8, 4), phase_s=10, idle_every_s=60, idle_gap_s=15)
    assert [shape.level_at(t) for t in (0, 9.9, 10, 25, 30, 44.9)] == [2, 2, 8, 4, 2, 8]
    assert shape.level_at(45) == shape.level_at(59.9) == 0  # the idle gap
    assert shape.level_at(60) == 2
    assert Shape(levels=(3,)).level_at(1e6) == 3  # no gaps unless asked


def test_sessions_share_a_system_prompt_then_diverge():
    import random

    a = new_session(random.Random(1), Shape(), shared_prompt(50))
    b = new_session(random.Random(2), Shape(), shared_prompt(50))
    assert a.messages[0] == b.messages[0]  # one shared prefix
    assert a.messages[1] != b.messages[1]


def test_the_soak_policy_is_valid_and_binds_under_the_limit(tmp_path):
    soak = Soak(tmp_path / "a", tmp_path / "b", 2 * GIB, context=4096, concurrency=2)
    pol = parse_policy(soak_policy(soak, 16 * GIB), "soak")
    assert set(pol.models) == {"a", "b"}
    assert pol.budget_bytes("standalone") <= 0.9 * 2 * GIB - 384 * MIB + MIB  # the soft line
    assert pol.models["a"].context == 4096


def test_proxy_events_count_kinds_and_sigkilled_workers():
    log = "\n".join([
        "2026-01-01 plimsoll.proxy event spawn a {'port': 1}",
        "2026-01-01 plimsoll.proxy event exit a {'pid': 3, 'returncode': -9, 'exit': 'x'}",
        "2026-01-01 plimsoll.proxy event exit b {'pid': 4, 'returncode': 0}",
        "2026-01-01 plimsoll.proxy event idle-unload b {'idle_s': 5}"])
    got = proxy_events(log)
    assert got["events"] == {"exit": 2, "idle-unload": 1, "spawn": 1}
    assert got["workers_sigkilled"] == 1
    assert error_code(b'{"error": {"code": "pool_exhausted"}}') == "pool_exhausted"


def _target(**over) -> dict:
    base = {"label": "plimsoll", "ran": True, "models": ["a", "b"], "limit_bytes": GIB,
            "max_usage_bytes": GIB // 2, "oom_kills": 0, "oom_kills_in_cgroup": 0,
            "oom_kills_below": 0, "deaths": [], "alive_at_end": True, "failcnt": 0,
            "after_load": {"seconds": 0.1, "tries": 1, "statuses": {"200": 1},
                           "wedged": False},
            "tracebacks": 0, "load_ran_s": 10, "peak_working_set_bytes": 1,
            "events": {}, "workers_sigkilled": 0,
            "records": [{"status": 200, "code": None, "words": 10, "kind": "turn",
                         "model": "a", "stream": True, "cancelled": False},
                        {"status": 503, "code": "pool_exhausted", "words": 10,
                         "kind": "churn", "model": "b", "stream": False,
                         "cancelled": False}]}
    return {**base, **over}


@pytest.mark.parametrize(("over", "why"), [
    ({}, None),
    ({"oom_kills": 1}, "OOM kill"),
    ({"after_load": {"seconds": None, "tries": 9, "statuses": {"503": 9}, "wedged": True}},
     "wedged"),
    ({"deaths": [{"t_s": 3, "exit_status": -9}]}, "exited"),
    ({"tracebacks": 2}, "traceback"),
])
def test_the_verdict_fails_on_an_oom_kill_a_wedge_an_exit_or_a_traceback(over, why):
    result = build({}, [_target(**over)])
    assert result["passed"] is (why is None)
    if why:
        assert any(why in f for f in result["failures"]), result["failures"]
    target = result["targets"][0]
    assert target["refusals"] == {"503 pool_exhausted": 1}
    assert target["requests"]["other_model"] == 1


def test_an_uncoded_refusal_or_a_broken_connection_fails():
    recs = _target()["records"]
    summary = build({}, [_target(records=[*recs, {**recs[1], "status": 500, "code": None}])])
    assert not summary["passed"] and "not controlled" in summary["failures"][0]
    broken = build({}, [_target(records=[*recs, {**recs[1], "status": "transport:ReadError"}])])
    assert not broken["passed"] and "broken connection" in broken["failures"][0]
    assert verdict({"ran": False, "reason": "no cgroup"})[0] is False


def cgroup_why() -> str | None:
    from plimsoll.guard import cgroups

    return cgroups.unavailable_reason()


@pytest.mark.skipif(cgroup_why() is not None, reason=f"needs a memory cgroup: {cgroup_why()}")
def test_verify_soak_holds_the_bound_and_never_wedges(tiny_model, tmp_path):
    """20 s of load at 2-8 clients on two models (a swap costs a worker's whole footprint:
    context 32768 × 4 sequences), under a 1 GiB cgroup: 0 OOM kills, every refusal coded,
    the first request after the load admitted, the report written."""
    from plimsoll.demo.model import build_demo_model

    other = build_demo_model(tmp_path / "tiny-b", preset="tiny", seed=1)
    env = {**os.environ, "PLIMSOLL_CACHE": str(tmp_path / "cache")}
    if os.path.exists(OPENBLAS := "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"):
        env.setdefault("LD_PRELOAD", OPENBLAS)
    done = subprocess.run(
        [sys.executable, "-m", "plimsoll.cli", "verify", str(tiny_model), "--soak",
         "--model-b", str(other), "--duration", "20", "--limit-mib", "1024",
         "--context", "32768", "--no-contrast", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "**Verdict: PASS**" in done.stdout
    (report,) = (tmp_path / "out").glob("soak-*.json")
    result = json.loads(report.read_text())
    (ours,) = result["targets"]
    assert result["passed"] and ours["oom_kills"] == 0 and not ours["deaths"]
    assert ours["after_load"]["wedged"] is False and ours["after_load"]["seconds"] < 60
    assert ours["requests"]["served"] > 0 and ours["transport_errors"] == 0
    assert all(not k.startswith("5") or k.startswith("503 ") for k in ours["refusals"])
    assert ours["max_usage_bytes"] <= ours["limit_bytes"] == 1024 * MIB
    assert ours["events"].get("spawn", 0) >= 1 and ours["workers_sigkilled"] == 0
    assert (tmp_path / "out" / report.name.replace(".json", ".md")).read_text() == \
        markdown(result)
