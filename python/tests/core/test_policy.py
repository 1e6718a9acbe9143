"""The policy file: schema drift, invariants, and errors that name the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from plimsoll.cli.main import main
from plimsoll.core.policy import (
    PolicyError,
    committed_schema,
    load_policy,
    parse_policy,
    policy_json_schema,
)
from plimsoll.core.units import GIB

pytestmark = pytest.mark.pure

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "policy.json"


@pytest.fixture
def example() -> dict:
    return json.loads(EXAMPLE.read_text())


def test_committed_schema_matches_models():
    assert committed_schema() == policy_json_schema(), (
        "python/plimsoll/core/policy.schema.json drifted from the models: regenerate it with "
        "`plimsoll policy schema > python/plimsoll/core/policy.schema.json`"
    )


def test_example_validates_against_schema_and_models(example):
    jsonschema.validate(example, committed_schema())
    pol = parse_policy(example)
    assert pol.host == "studio"
    assert pol.budget_bytes("standalone") == 72 * GIB
    assert pol.budget_bytes("clustered") == 80 * GIB
    assert pol.models["demo"].default_max_tokens == 512  # schema default applied
    assert pol.trip_offset == 0.05 and pol.u_margin == 0.02


def _error(data: dict) -> str:
    with pytest.raises(PolicyError) as exc:
        parse_policy(data, "p.json")
    return str(exc.value)


def test_unknown_key_names_the_field(example):
    example["models"]["demo"]["contxt"] = 4096
    msg = _error(example)
    assert "models.demo" in msg and "contxt" in msg


def test_wrong_type_names_the_field(example):
    example["modes"]["standalone"]["maxLocalLlmGb"] = "lots"
    msg = _error(example)
    assert "modes.standalone.maxLocalLlmGb" in msg


def test_budget_breaking_os_floor(example):
    example["totalRamGb"] = 64
    example["osFloorGb"] = 8
    example["modes"] = {"standalone": {"maxLocalLlmGb": 60}, "clustered": {"maxLocalLlmGb": 60}}
    msg = _error(example)
    assert "modes.standalone.maxLocalLlmGb" in msg
    assert "standalone budget 60 GiB leaves 4 GiB" in msg
    assert "OS floor of 8 GiB" in msg


def test_clustered_below_standalone(example):
    example["modes"]["clustered"]["maxLocalLlmGb"] = 40
    msg = _error(example)
    assert "modes.clustered.maxLocalLlmGb" in msg and "below" in msg


def test_output_reservation_must_fit_context(example):
    example["models"]["demo"]["maxTokens"] = 8192
    msg = _error(example)
    assert "models.demo" in msg and "maxTokens (8192) must be below context (8192)" in msg


def test_missing_field_and_bad_model_name(example):
    bad = copy.deepcopy(example)
    del bad["osFloorGb"]
    assert "osFloorGb" in _error(bad)
    bad = copy.deepcopy(example)
    bad["models"]["bad name!"] = bad["models"].pop("demo")
    assert "bad name!" in _error(bad)


def test_policy_is_frozen(example):
    pol = parse_policy(example)
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen error type varies
        pol.host = "other"  # type: ignore[misc]


def test_load_policy_file_errors(tmp_path):
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PolicyError, match="not valid JSON"):
        load_policy(bad)


def test_cli_policy_check(tmp_path, example):
    runner = CliRunner()
    ok = runner.invoke(main, ["policy", "check", str(EXAMPLE)])
    assert ok.exit_code == 0, ok.output
    assert "studio" in ok.output and "72 GiB" in ok.output
    assert "73728 MiB" in ok.output  # wired ceiling of the standalone budget, exact
    example["osFloorGb"] = 30
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps(example))
    res = runner.invoke(main, ["policy", "check", str(bad)])
    assert res.exit_code == 2
    assert "below the OS floor of 30 GiB" in res.output


def test_cli_policy_schema_is_the_committed_one():
    res = CliRunner().invoke(main, ["policy", "schema"])
    assert res.exit_code == 0
    assert json.loads(res.output) == committed_schema()
