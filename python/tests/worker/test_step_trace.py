"""PLIMSOLL_STEP_TRACE: one JSON line per planned step, with the engine's memory figures."""

from __future__ import annotations

import json

import pytest

from plimsoll.engine.work import Step, Work
from plimsoll.worker.trace import ENV, StepTrace

pytestmark = pytest.mark.pure


class Figures:
    """An engine's memory figures (the one method the trace calls)."""

    def __init__(self):
        self.resets = 0

    def memory(self, reset_peak: bool = False) -> dict[str, int]:
        out = {"active": 10, "peak": 12 + self.resets, "cache": 3}
        self.resets += reset_peak
        return out


def test_off_without_the_variable_and_one_line_a_step_with_it(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert StepTrace.from_env() is None
    monkeypatch.setenv(ENV, str(tmp_path / "t.jsonl"))
    trace, eng = StepTrace.from_env(), Figures()
    step = Step(decodes=(Work(1, None, 40, (0, 1, 2), True),),
                prefills=(Work(2, (5,) * 32, 16, (3, 4, 5), False),))
    trace.line(eng, "step", step, 7)
    trace.line(eng, "warm")
    rows = [json.loads(s) for s in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["what"] for r in rows] == ["step", "warm"]
    assert rows[0]["step"] == 7 and rows[0]["decodes"] == 1 and rows[0]["chunks"] == [[32, 16]]
    assert rows[1]["peak"] == 13 and eng.resets == 2  # the peak starts again after each line
