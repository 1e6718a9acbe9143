"""The tripwire's pure decisions (classify, hysteresis, actions) and its state keeper."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plimsoll.core.policy import Pressure
from plimsoll.probes.pressure import PressureReading
from plimsoll.proxy.events import EventLog
from plimsoll.proxy.evict import Resident
from plimsoll.proxy.pressure import (
    RANK,
    TripState,
    choose_unload,
    classify,
    decide,
    page_out_rate,
    step,
)
from plimsoll.proxy.tripwire import Tripwire

pytestmark = pytest.mark.pure

TH = Pressure()


def psi(some: float, full: float | None = 0.0, t: float = 0.0,
        page_outs: int | None = 0) -> PressureReading:
    return PressureReading("linux", t, some_avg10=some, full_avg10=full, page_outs=page_outs)


def mac(level: int, t: float = 0.0, page_outs: int = 0) -> PressureReading:
    return PressureReading("darwin", t, darwin_level=level, page_outs=page_outs)


@pytest.mark.parametrize(("reading", "level", "names"), [
    (psi(0.0), "normal", ""),
    (psi(9.99, 4.99), "normal", ""),
    (psi(10.0), "warn", "pressure.someAvg10Warn"),
    (psi(24.99, 4.99), "warn", "pressure.someAvg10Warn"),
    (psi(25.0), "critical", "pressure.someAvg10Critical"),
    (psi(60.0, 18.4), "critical", "pressure.fullAvg10Critical"),
    (psi(1.0, 5.0), "critical", "pressure.fullAvg10Critical"),
    (psi(3.0, None), "normal", ""),
    (mac(1), "normal", ""),
    (mac(2), "warn", "pressure.darwinLevel = warn"),
    (mac(4), "critical", "(critical)"),
])
def test_classify_names_the_line_each_reading_crossed(reading, level, names):
    got, reasons = classify(reading, None, TH)
    assert got == level
    assert (names in " ".join(reasons)) if names else reasons == ()


def test_darwin_level_critical_ignores_the_kernels_warn_but_not_its_critical():
    th = Pressure(darwinLevel="critical")
    assert classify(mac(2), None, th)[0] == "normal"
    assert classify(mac(4), None, th)[0] == "critical"


def test_page_outs_are_a_rate_between_two_readings():
    a, b = psi(0.0, t=10.0, page_outs=48000), psi(0.0, t=12.0, page_outs=49024)
    assert page_out_rate(a, b) == 512.0
    assert page_out_rate(None, b) is None
    assert page_out_rate(b, a) is None  # time went backwards: no rate
    assert page_out_rate(psi(0, t=1, page_outs=9), psi(0, t=2, page_outs=3)) == 0.0
    level, reasons = classify(b, a, TH)  # 512/s ≥ 256/s
    assert level == "critical" and "pressure.pageOutsPerS" in reasons[0]
    assert classify(b, a, Pressure(pageOutsPerS=1000))[0] == "normal"


def test_hysteresis_holds_warn_until_calm_for_clear_after_s():
    s = step(TripState(), "critical", ("x",), 0.0, 10.0)
    assert (s.level, s.raw, s.since) == ("critical", "critical", 0.0)
    s = step(s, "normal", (), 1.0, 10.0)
    assert (s.level, s.raw, s.reasons) == ("warn", "normal", ("x",))  # held, not reopened
    s = step(s, "normal", (), 9.9, 10.0)
    assert s.level == "warn"
    s = step(s, "warn", ("y",), 10.5, 10.0)  # a new alarm restarts the calm clock
    s = step(s, "normal", (), 20.4, 10.0)
    assert s.level == "warn"
    s = step(s, "normal", (), 20.5, 10.0)
    assert (s.level, s.since) == ("normal", 20.5)
    assert step(TripState(), "warn", (), 0.0, 0.0).level == "warn"
    assert step(step(TripState(), "warn", (), 0.0, 0.0), "normal", (), 0.0, 0.0).level == "normal"


def test_actions_per_level():
    idle_old = Resident("old", 1, last_used=1.0)
    idle_new = Resident("new", 1, last_used=5.0)
    busy = Resident("busy", 1, last_used=0.5, busy=True)
    crit = TripState(level="critical", raw="critical")
    a = decide(crit, [busy, idle_new, idle_old])
    assert (a.admit, a.cancel_waiting, a.unload) == (False, True, "old")
    assert decide(crit, [busy]).unload == "busy"  # no idle one left: LRU of the busy
    held = TripState(level="warn", raw="normal")
    assert decide(held, [idle_old]) == decide(held, [idle_old])
    assert decide(held, [idle_old]).unload is None and not decide(held, []).admit
    assert decide(TripState(), [idle_old]).admit


residents_st = st.lists(
    st.builds(Resident, name=st.text("abcdefgh", min_size=1, max_size=3),
              admitted_bytes=st.just(1), observed_bytes=st.just(0),
              last_used=st.floats(0, 1e6), busy=st.booleans()),
    max_size=8, unique_by=lambda r: r.name)


@given(residents_st)
def test_never_unloads_a_busy_worker_while_an_idle_one_is_resident(residents):
    name = choose_unload(residents)
    if not residents:
        assert name is None
        return
    chosen = next(r for r in residents if r.name == name)
    if any(not r.busy for r in residents):
        assert not chosen.busy
    same = [r for r in residents if r.busy == chosen.busy]
    assert chosen.last_used == min(r.last_used for r in same)  # least recently used


level_st = st.sampled_from(["normal", "warn", "critical"])


@settings(max_examples=300)
@given(st.lists(st.tuples(level_st, st.floats(0.01, 5.0)), max_size=40),
       st.floats(0.0, 20.0), residents_st)
def test_admission_reopens_only_after_clear_after_s_of_calm(seq, clear_after, residents):
    s, now, alarms = TripState(), 0.0, []
    for raw, dt in seq:
        now += dt
        s = step(s, raw, (), now, clear_after)
        if raw != "normal":
            alarms.append(now)
        assert RANK[s.level] >= RANK[raw]
        a = decide(s, residents)
        assert a.admit == (s.level == "normal") and a.cancel_waiting == (not a.admit)
        if a.admit:
            assert not alarms or now - alarms[-1] >= clear_after
        if a.unload is not None:
            assert raw == "critical"
        elif raw == "critical":
            assert not residents


class Reader:
    def __init__(self) -> None:
        self.next = psi(0.0)

    def __call__(self) -> PressureReading:
        return self.next


def test_the_tripwire_keeps_state_records_changes_and_refuses_with_reasons():
    clock = [0.0]
    events = EventLog()
    tw = Tripwire(Pressure(clearAfterS=5), events, Reader(), clock=lambda: clock[0])
    assert tw.refusal("x") is None and not tw.closed.is_set()
    tw.observe(psi(60.0, 18.4, t=1.0), [Resident("a", 1, last_used=0.5)])
    assert tw.closed.is_set() and events.kinds() == ["pressure-critical"]
    clock[0] = 2.0
    r = tw.refusal("a request for model 'a'")
    assert r is not None and r.retry_after == 5
    assert r.message.startswith("a request for model 'a' refused: the host is under memory "
                                "pressure (critical): PSI memory some avg10=60.00")
    assert r.extra["pressure"]["level"] == "critical"
    tw.observe(psi(0.0, t=3.0), [])
    clock[0] = 4.0
    r = tw.refusal("loading model 'a'")
    assert "readings calm for 3.0 s; admission reopens after 5 s" in r.message
    snap = tw.snapshot()
    assert (snap["level"], snap["raw"], snap["admitting"]) == ("warn", "normal", False)
    assert snap["reading"]["some_avg10"] == 0.0 and snap["calm_for_s"] == 3.0
    tw.observe(psi(0.0, t=8.0), [])
    assert not tw.closed.is_set() and tw.refusal("x") is None
    assert events.kinds() == ["pressure-critical", "pressure-easing", "pressure-clear"]
    clear = events.as_json()[-1]["detail"]
    assert clear["calm_for_s"] == 7.0 and clear["clear_after_s"] == 5


def test_a_blind_probe_is_recorded_once_and_does_not_close_admission():
    events = EventLog()
    tw = Tripwire(Pressure(), events, Reader())
    blind = PressureReading("linux", 1.0, error="cannot read /x: No such file or directory")
    for t in (1.0, 2.0, 3.0):
        tw.observe(PressureReading("linux", t, error=blind.error), [])
    assert events.kinds() == ["pressure-probe-failed"] and tw.refusal("x") is None


def test_waiters_race_the_closed_event():
    async def main() -> bool:
        tw = Tripwire(Pressure(), EventLog(), Reader())
        waiter = asyncio.ensure_future(tw.closed.wait())
        await asyncio.sleep(0)
        tw.observe(psi(12.0, t=1.0), [])
        return await asyncio.wait_for(waiter, 5)

    assert asyncio.run(main()) is True


def test_a_disabled_tripwire_never_refuses_and_the_supervisor_does_not_poll(tmp_path):
    from plimsoll.core.policy import parse_policy
    from plimsoll.proxy.supervisor import Supervisor

    tw = Tripwire(Pressure(enabled=False), EventLog(), Reader())
    tw.observe(psi(90.0, 50.0, t=1.0), [])
    assert tw.refusal("x") is None and tw.snapshot()["enabled"] is False

    def policy(enabled: bool):
        return parse_policy({
            "schemaVersion": 1, "host": "h", "totalRamGb": 16, "osFloorGb": 4,
            "modes": {"standalone": {"maxLocalLlmGb": 8}, "clustered": {"maxLocalLlmGb": 8}},
            "pressure": {"enabled": enabled}, "models": {}})

    async def main(enabled: bool) -> bool:
        sup = Supervisor(policy(enabled), "standalone", read_snapshot=lambda *a: None)
        sup.start_background()
        running = sup._pressure_task is not None
        await sup.shutdown()
        return running

    assert asyncio.run(main(False)) is False
    assert asyncio.run(main(True)) is True
