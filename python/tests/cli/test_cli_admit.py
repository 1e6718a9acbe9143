"""``plimsoll admit`` end to end: a real demo model, real header reads, DESIGN.md to the byte."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from plimsoll.cli.main import main
from plimsoll.core.model_facts import inspect_model
from plimsoll.core.units import GIB, MIB

EXAMPLE_ARGS = ["--budget-gib", "8", "--ceiling-mib", "8192", "--total-ram-gib", "16",
                "--concurrency", "4", "--context", "8192", "--max-tokens", "1024", "--json"]
REQUIRED_KEYS = {
    "kv_layers", "kv_bytes_per_token", "block_tokens", "block_bytes", "weights_bytes",
    "budget_bytes", "transient_reserve_bytes", "pool_blocks", "concurrency", "context",
    "output_reservation", "gpu_memory_utilization", "band_low", "band_high",
    "allocation_limit_bytes", "trip_bytes", "ceiling_bytes", "total_ram_bytes", "decision",
    "reasons",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from plimsoll.demo.model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("m") / "tiny", preset="tiny")


def run_admit(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["admit", *args])
    return res.exit_code, res.output


def test_issue_example_follows_design_to_the_byte(tiny):
    code, out = run_admit(str(tiny), *EXAMPLE_ARGS)
    assert code == 0, out
    got = json.loads(out)
    assert got.keys() >= REQUIRED_KEYS
    facts = inspect_model(tiny)
    cfg = json.loads((tiny / "config.json").read_text())
    # The arithmetic written out independently of plimsoll.core.admission:
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    block_bytes = kv_per_token * 16
    ceiling, total, budget = 8192 * MIB, 16 * GIB, 8 * GIB
    band_high = ceiling / total - 0.05  # 0.45
    u = band_high - 0.02  # 0.43
    reserve = math.floor(0.05 * budget)
    pool = (math.floor((u - 0.02) * ceiling) - facts.weights_bytes - reserve) // block_bytes
    assert got["kv_layers"] == cfg["num_hidden_layers"]
    assert got["kv_bytes_per_token"] == kv_per_token
    assert got["block_tokens"] == 16 and got["block_bytes"] == block_bytes
    assert got["weights_bytes"] == facts.weights_bytes
    assert got["budget_bytes"] == budget
    assert got["ceiling_bytes"] == ceiling and got["total_ram_bytes"] == total
    assert got["transient_reserve_bytes"] == reserve
    assert math.isclose(got["band_high"], 0.45) and math.isclose(got["gpu_memory_utilization"], u)
    assert got["pool_blocks"] == pool
    assert got["allocation_limit_bytes"] == math.floor(u * ceiling)
    assert got["trip_bytes"] == math.floor((u + 0.05) * total)
    footprint = facts.weights_bytes + reserve + pool * block_bytes
    assert math.isclose(got["band_low"], footprint / ceiling)
    assert footprint < got["trip_bytes"] < ceiling
    assert got["concurrency"] == 4 and got["context"] == 8192
    assert got["output_reservation"] == 1024
    assert got["decision"] == "admit" and got["reasons"] == []


def test_refusal_exit_status_and_reasons(tiny):
    code, out = run_admit(str(tiny), "--budget-gib", "0.01", "--ceiling-mib", "8192",
                          "--total-ram-gib", "16", "--json")
    assert code == 3
    got = json.loads(out)
    assert got["decision"] == "refuse"
    assert any("does not fit" in r for r in got["reasons"])


def test_clamp_is_exit_zero_and_explained(tiny):
    code, out = run_admit(str(tiny), "--budget-gib", "0.1", "--ceiling-mib", "8192",
                          "--total-ram-gib", "16", "--concurrency", "64", "--context", "8192",
                          "--max-tokens", "512")
    assert code == 0, out
    assert "ADMIT (clamped)" in out and "concurrency clamped from 64" in out


def test_live_probe_without_overrides(tiny):
    code, out = run_admit(str(tiny), "--json")
    assert code == 0, out
    got = json.loads(out)
    # On Linux the process's whole world is min(cgroup limit, MemTotal).
    assert got["ceiling_bytes"] == got["total_ram_bytes"]
    assert math.isclose(got["band_high"], 0.95)


def test_policy_registry_name_is_resolved(tiny, tmp_path):
    policy = {
        "schemaVersion": 1, "host": "box", "totalRamGb": 16, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 8}, "clustered": {"maxLocalLlmGb": 10}},
        "models": {"tiny": {"path": str(tiny), "context": 4096, "concurrency": 2,
                            "maxTokens": 256}},
    }
    p = tmp_path / "policy.json"
    p.write_text(json.dumps(policy))
    code, out = run_admit("tiny", "--policy", str(p), "--ceiling-mib", "8192",
                          "--total-ram-gib", "16", "--mode", "clustered", "--json")
    assert code == 0, out
    got = json.loads(out)
    assert got["budget_bytes"] == 10 * GIB
    assert (got["context"], got["concurrency"], got["output_reservation"]) == (4096, 2, 256)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["/nonexistent/model"], "/nonexistent/model"),
        (["--concurrency", "0"], "--concurrency"),
        (["--mode", "party"], "--mode"),
    ],
)
def test_bad_input_is_exit_two_with_a_message(tiny, args, needle):
    if args[0].startswith("--"):
        args = [str(tiny), *args]
    code, out = run_admit(*args)
    assert code == 2
    assert needle in out


def test_bad_policy_is_exit_two(tiny, tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"schemaVersion": 1}')
    code, out = run_admit(str(tiny), "--policy", str(p))
    assert code == 2 and "host" in out


def test_console_script_runs_without_importing_mlx(tiny):
    """The CLI's start-up never imports the engine: admit stays fast and engine-free."""
    code = (
        "import sys, runpy; sys.argv = ['plimsoll', 'admit', sys.argv[1], '--json'];"
        "from plimsoll.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
        "assert 'mlx' not in sys.modules and 'mlx_lm' not in sys.modules, 'mlx imported'\n"
        "print('ENGINE-FREE')"
    )
    env = dict(os.environ)
    res = subprocess.run([sys.executable, "-c", code, str(tiny)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert "ENGINE-FREE" in res.stdout, res.stderr
