"""The engine thread's steady-decode clock (worker/stats.HostClock): pure."""

from __future__ import annotations

import time

import pytest

from plimsoll.worker.stats import HostClock


@pytest.mark.pure
def test_only_passes_that_submit_decode_rows_only_are_counted() -> None:
    clock = HostClock()
    for decode_only in (True, False, True):
        clock.begin_pass()
        began = clock.now()
        since = clock.now()
        t = time.perf_counter()
        while time.perf_counter() - t < 0.002:  # on the CPU: thread time moves too
            pass
        clock.part("build", since)
        clock.part("iterate", began)
        clock.end_pass(decode_only)
    f = clock.figures()
    assert f["steps"] == 2
    assert 4.0 <= f["build_ms"] <= f["iterate_ms"]  # two passes of ≥ 2 ms each
    assert f["build_cpu_ms"] > 0 and f["wait_ms"] == 0 and f["flush_ms"] == 0


@pytest.mark.pure
def test_a_part_noted_twice_in_a_pass_adds_up_and_a_new_pass_forgets_an_uncounted_one() -> None:
    clock = HostClock()
    clock.begin_pass()
    clock.part("wait", (clock.now()[0] - 0.5, clock.now()[1]))
    clock.part("wait", (clock.now()[0] - 0.25, clock.now()[1]))
    clock.begin_pass()  # the pass above ended without end_pass (the warm-up's continue)
    clock.part("wait", (clock.now()[0] - 0.125, clock.now()[1]))
    clock.end_pass(True)
    assert clock.figures()["wait_ms"] == pytest.approx(125, abs=1)
