"""Progress: plain timestamped lines when the stream is not a terminal, rich's status on one."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from plimsoll.core.progress import progress

pytestmark = pytest.mark.pure

PLAIN = re.compile(r"^\[\s*\d+\.\ds\] [^\x1b\r]+$")


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_tty_gives_plain_lines():
    out = io.StringIO()
    with progress("loading tiny", stream=out) as report:
        report("starting the worker")
        report("ready")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert all(PLAIN.match(line) for line in lines), lines
    assert lines[0].endswith("loading tiny: starting the worker")
    assert lines[-1].endswith("loading tiny: done")


def test_a_failure_prints_no_done_line():
    out = io.StringIO()
    try:
        with progress("loading tiny", stream=out) as report:
            report("starting the worker")
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert "done" not in out.getvalue()


def test_a_tty_gets_the_live_status():
    out = FakeTTY()
    with progress("loading tiny", stream=out) as report:
        report("starting the worker")
    text = out.getvalue()
    assert "starting the worker" in text and "done in" in text


@pytest.mark.impure
def test_the_demo_model_command_reports_plain_lines_off_a_terminal(tiny_model):
    r = subprocess.run([sys.executable, "-m", "plimsoll.cli", "demo-model", str(tiny_model)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines and all(PLAIN.match(line) for line in lines), lines
    assert any("already holds this demo model" in line for line in lines)
    assert r.stdout.strip() == str(tiny_model)
