"""The policy's ``pressure`` block: defaults, valid settings, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plimsoll.core.policy import Policy, PolicyError, Pressure, parse_policy

pytestmark = pytest.mark.pure

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "policy.json"


@pytest.fixture
def example() -> dict:
    return json.loads(EXAMPLE.read_text())


def test_an_omitted_block_gets_the_defaults(example):
    example.pop("pressure", None)
    p = parse_policy(example).pressure
    assert p == Pressure()
    assert p.model_dump(by_alias=True) == {
        "enabled": True, "someAvg10Warn": 10, "someAvg10Critical": 25, "fullAvg10Critical": 5,
        "pageOutsPerS": 256, "darwinLevel": "warn", "pollS": 1, "clearAfterS": 10}


def test_a_partial_block_is_read_in_camel_case(example):
    example["pressure"] = {"someAvg10Warn": 5, "pollS": 0.25, "clearAfterS": 0,
                           "darwinLevel": "critical", "enabled": False}
    p = parse_policy(example).pressure
    assert (p.some_avg10_warn, p.poll_s, p.clear_after_s, p.darwin_level, p.enabled) == (
        5, 0.25, 0, "critical", False)
    assert p.some_avg10_critical == 25  # the rest keep their defaults


@pytest.mark.parametrize(("block", "says"), [
    ({"someAvg10Warn": 30}, "pressure.someAvg10Warn (30) is above pressure.someAvg10Critical "
                            "(25): lower the warn line or raise the critical one"),
    ({"someAvg10Critical": 150}, "pressure.someAvg10Critical: 150 is greater than the "
                                 "maximum of 100"),
    ({"fullAvg10Critical": 0}, "pressure.fullAvg10Critical: 0 is less than or equal to the "
                               "minimum of 0"),
    ({"pageOutsPerS": -1}, "pressure.pageOutsPerS: -1 is less than or equal to the minimum"),
    ({"pollS": 0}, "pressure.pollS: 0 is less than or equal to the minimum"),
    ({"clearAfterS": 7200}, "pressure.clearAfterS: 7200 is greater than the maximum of 3600"),
    ({"darwinLevel": "urgent"}, "pressure.darwinLevel: 'urgent' is not one of ['warn', "
                                "'critical']"),
    ({"enabled": "yes"}, "pressure.enabled: 'yes' is not of type 'boolean'"),
    ({"someAvg60Warn": 5}, "pressure: Additional properties are not allowed ('someAvg60Warn'"),
])
def test_bad_values_name_the_field(example, block, says):
    example["pressure"] = block
    with pytest.raises(PolicyError) as exc:
        parse_policy(example, "host.json")
    assert says in str(exc.value), str(exc.value)


def test_the_model_rejects_what_the_schema_rejects():
    """Built in Python (no schema pass), the models refuse the same values."""
    with pytest.raises(ValueError, match="someAvg10Warn"):
        Pressure(someAvg10Warn=30)
    with pytest.raises(ValueError):
        Pressure(pollS=0)
    assert "pressure" in Policy.model_fields
