"""Nix and Python agree on the policy: every field, every unit, every refusal.

The Nix side (``modules/policy.nix``, pure builtins) writes ``/etc/plimsoll/policy.json``;
the Python side (:mod:`plimsoll.core.policy`) reads it. For each example host in ``hosts/``
this test takes the JSON that ``nix-instantiate`` generates, validates it against the
committed JSON Schema, loads it with ``plimsoll policy check``, then runs
``plimsoll admit`` against it for a demo model and checks that admission used the
budgets, reserve and per-model settings exactly as Nix wrote them (GiB × 1024³ bytes,
MiB × 1024² for the wired ceiling). It also replays the Nix test suite's declarations
(``tests/policy-eval.nix``, attribute ``mirror``): what Nix refuses, Python refuses.

Skipped when ``nix-instantiate`` is absent (CI installs Debian's ``nix-bin``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from plimsoll.core.policy import SCHEMA_PATH, Policy, PolicyError, parse_policy
from plimsoll.core.units import GIB, MIB

REPO = Path(__file__).resolve().parents[3]
NIX_INSTANTIATE = shutil.which("nix-instantiate")
HOSTS = ("studio", "studio-b", "macbook")
MODES = ("standalone", "clustered")

pytestmark = pytest.mark.skipif(NIX_INSTANTIATE is None, reason="nix-instantiate not installed")


def nix_eval(expr: str) -> object:
    """Evaluate a Nix expression (in the repo root) strictly to JSON."""
    env = {**os.environ, "NIX_CONFIG": os.environ.get("NIX_CONFIG", "")}
    res = subprocess.run(
        [NIX_INSTANTIATE, "--eval", "--strict", "--json", "--expr", expr],
        cwd=REPO, capture_output=True, text=True, env=env, check=False,
    )
    if res.returncode != 0:
        raise AssertionError(f"nix-instantiate failed on {expr!r}:\n{res.stderr}")
    return json.loads(res.stdout)


def nix_string(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid Nix string literal here


def host_policy_expr(host: str, model_dir: Path | None = None) -> str:
    """The checked policy of hosts/<host>.nix, every model pointed at MODEL_DIR if given."""
    decl = f"(import ./hosts).{host}"
    if model_dir is not None:
        decl = (f"({decl} // {{ models = builtins.mapAttrs (_: m: m // {{ path = "
                f"{nix_string(str(model_dir))}; }}) {decl}.models; }})")
    return f"(import ./modules/policy.nix).checkedPolicy {decl}"


def plimsoll_cli() -> list[str]:
    """The ``plimsoll`` console script next to this interpreter, else ``-m plimsoll.cli``."""
    script = Path(sys.executable).with_name("plimsoll")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "plimsoll.cli"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*plimsoll_cli(), *args], capture_output=True, text=True, check=False)


@pytest.fixture(scope="session")
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    """A tiny random-weight model, built once with ``plimsoll demo-model``."""
    out = tmp_path_factory.mktemp("nix-policy") / "demo-tiny"
    res = run_cli("demo-model", str(out), "--preset", "tiny")
    if res.returncode != 0:
        pytest.fail(f"plimsoll demo-model failed:\n{res.stdout}\n{res.stderr}")
    return out


@pytest.fixture(scope="session")
def nix_policies() -> dict[str, dict]:
    return {h: nix_eval(host_policy_expr(h)) for h in HOSTS}


def test_the_example_hosts_are_the_expected_ones():
    # If a host is added to hosts/, this test (and tests/expected/) must learn about it.
    assert sorted(nix_eval("builtins.attrNames (import ./hosts)")) == sorted(HOSTS)


@pytest.mark.parametrize("host", HOSTS)
def test_nix_json_validates_against_the_committed_schema(host, nix_policies, schema):
    jsonschema.Draft202012Validator(schema).validate(nix_policies[host])


@pytest.mark.parametrize("host", HOSTS)
def test_nix_json_matches_the_committed_expected_file(host, nix_policies):
    expected = json.loads((REPO / "tests" / "expected" / f"{host}.json").read_text())
    assert nix_policies[host] == expected


@pytest.mark.parametrize("host", HOSTS)
def test_python_reads_back_every_field_unchanged(host, nix_policies):
    """Nix writes every field explicitly; Python keeps each one as written (no coercion)."""
    data = nix_policies[host]
    pol = parse_policy(data, f"nix:{host}")
    assert pol.model_dump(by_alias=True, mode="json") == data
    assert set(data) == {f.alias or name for name, f in Policy.model_fields.items()}


@pytest.mark.parametrize("host", HOSTS)
def test_policy_check_accepts_the_nix_json(host, nix_policies, tmp_path):
    path = tmp_path / f"{host}.json"
    path.write_text(json.dumps(nix_policies[host]))
    res = run_cli("policy", "check", str(path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert host in res.stdout


@pytest.mark.parametrize("host", HOSTS)
def test_units_agree(host, nix_policies):
    data = nix_policies[host]
    pol = parse_policy(data, f"nix:{host}")
    for mode in MODES:
        gib = data["modes"][mode]["maxLocalLlmGb"]
        assert pol.budget_bytes(mode) == int(gib * GIB)
        # What the link watcher writes to iogpu.wired_limit_mb: the budget in whole MiB.
        assert pol.budget_bytes(mode) // MIB == int(gib * 1024)
        # The OS floor is left, in the same unit, on both sides.
        assert data["totalRamGb"] - gib >= data["osFloorGb"]
    # The Nix side's own conversion (modules/policy.nix gibToBytes) is the same floor(GiB × 1024³).
    nix_bytes = nix_eval(
        "let p = import ./modules/policy.nix; h = (import ./hosts)." + host + "; in "
        "map (m: p.gibToBytes (p.checkedPolicy h).modes.${m}.maxLocalLlmGb) "
        '[ "standalone" "clustered" ]'
    )
    assert nix_bytes == [pol.budget_bytes(m) for m in MODES]


def test_defaults_agree():
    """A declaration with only the required fields: Nix's filled-in defaults are pydantic's."""
    decl = ('{ host = "min"; totalRamGb = 16; osFloorGb = 4; maxLocalLlmGb.standalone = 8; '
            'models.m = { path = "/m"; context = 8192; }; }')
    from_nix = nix_eval(f"(import ./modules/policy.nix).checkedPolicy {decl}")
    bare = {
        "schemaVersion": 1, "host": "min", "totalRamGb": 16, "osFloorGb": 4,
        "modes": {"standalone": {"maxLocalLlmGb": 8}, "clustered": {"maxLocalLlmGb": 8}},
        "models": {"m": {"path": "/m", "context": 8192}},
    }
    from_python = parse_policy(bare).model_dump(by_alias=True, mode="json")
    assert from_nix == from_python


def test_every_nix_verdict_is_pythons():
    """Each declaration in tests/policy-eval.nix: Nix refuses ⇔ Python refuses the JSON."""
    cases = nix_eval("(import ./tests/policy-eval.nix).mirror")
    assert len(cases) > 20
    disagreements = []
    for case in cases:
        try:
            parse_policy(case["policy"], case["name"])
            python_valid = True
        except PolicyError:
            python_valid = False
        if python_valid != case["expectValid"]:
            disagreements.append(f"{case['name']}: Nix valid={case['expectValid']}, "
                                 f"Python valid={python_valid}")
    assert not disagreements, "\n".join(disagreements)


def test_the_broken_host_is_refused_on_both_sides_with_the_same_figures(tmp_path):
    broken = "import ./tests/hosts/broken-mini.nix"
    errors = nix_eval(f"(import ./modules/policy.nix).errors ({broken})")
    assert any(e.startswith("host mini: standalone budget 60 GiB leaves 4 GiB, below the OS "
                            "floor of 8 GiB") for e in errors), errors
    # The JSON Nix would have written had it not refused: Python refuses it too, naming
    # the same host, mode, budget, what it leaves and the floor.
    unchecked = nix_eval(f"(import ./modules/policy.nix).policyOf ({broken})")
    path = tmp_path / "mini.json"
    path.write_text(json.dumps(unchecked))
    res = run_cli("policy", "check", str(path))
    assert res.returncode == 2, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert "host mini: standalone budget 60 GiB leaves 4 GiB" in out
    assert "below the OS floor of 8 GiB" in out


def _admit(policy_file: Path, model: str, mode: str, ceiling_mib: int, total_gib: float) -> dict:
    res = run_cli("admit", model, "--policy", str(policy_file), "--mode", mode,
                  "--ceiling-mib", str(ceiling_mib), "--total-ram-gib", repr(total_gib), "--json")
    assert res.returncode in (0, 3), res.stdout + res.stderr
    out = json.loads(res.stdout)
    out["_exit"] = res.returncode
    return out


@pytest.mark.parametrize("host", HOSTS)
def test_admit_uses_the_nix_policy_figure_by_figure(host, demo_model, tmp_path):
    """``plimsoll admit`` on the Nix JSON: the host as the watcher would set it up
    (ceiling = the mode's budget in MiB, total RAM as declared), each model by name."""
    data = nix_eval(host_policy_expr(host, demo_model))
    path = tmp_path / f"{host}.json"
    path.write_text(json.dumps(data))
    for mode in MODES:
        budget_gib = data["modes"][mode]["maxLocalLlmGb"]
        budget_bytes = int(budget_gib * GIB)
        ceiling_mib = budget_bytes // MIB
        for name, entry in data["models"].items():
            got = _admit(path, name, mode, ceiling_mib, data["totalRamGb"])
            where = f"{host}/{mode}/{name}"
            assert got["_exit"] == 0 and got["decision"] in ("admit", "clamp"), (where, got)
            assert got["mode"] == mode
            assert got["model_dir"] == str(demo_model)
            # Budgets: GiB × 1024³; the ceiling: MiB × 1024²; total RAM: GiB × 1024³.
            assert got["budget_bytes"] == budget_bytes, where
            assert got["ceiling_bytes"] == ceiling_mib * MIB == budget_bytes, where
            assert got["total_ram_bytes"] == int(data["totalRamGb"] * GIB), where
            assert got["transient_reserve_bytes"] == int(data["transientReserve"] * budget_bytes)
            assert got["block_tokens"] == data["blockTokens"], where
            # The band: u < ceiling / total − tripOffset, kept uMargin inside it.
            band_high = ceiling_mib * MIB / (data["totalRamGb"] * GIB) - data["tripOffset"]
            assert got["band_high"] == pytest.approx(band_high), where
            assert got["gpu_memory_utilization"] == pytest.approx(band_high - data["uMargin"])
            assert got["trip_bytes"] == int(
                min(got["gpu_memory_utilization"] + data["tripOffset"], 0.99)
                * data["totalRamGb"] * GIB), where
            assert got["footprint_bytes"] <= budget_bytes, where
            # The model entry, as Nix wrote it.
            assert got["requested_concurrency"] == entry["concurrency"], where
            assert got["requested_context"] == entry["context"], where
            assert got["output_reservation"] == entry["maxTokens"], where
            if entry["kvDtype"] != "auto":
                assert got["kv_dtype"] == entry["kvDtype"], where
            assert f"policy {host} {mode}" in got["sources"], where
