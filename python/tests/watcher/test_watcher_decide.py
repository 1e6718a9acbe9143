"""The watcher's pure decision, its debounce and backoff, and the loop on in-memory fakes.

The decision is checked as a table (each step of an upshift and a downshift) and as
properties over every observation (no write below in-use, the two orders). The loop
(``Watcher.run``) is then driven by fakes with a fake clock, so the recorded sequence of
effects shows the orders end to end; test_watcher_netns.py does the same for real.
"""

from __future__ import annotations

import io
import itertools
import threading

import pytest
from conftest import parse_log_line
from hypothesis import given
from hypothesis import strategies as st

from plimsoll.core.units import GIB, MIB
from plimsoll.watcher.decide import (
    Hold,
    Observation,
    ProxyAnswer,
    Retry,
    Settle,
    Targets,
    TellProxy,
    WriteCeiling,
    backoff_delay,
    check_write,
    decide,
)
from plimsoll.watcher.link import LinkState
from plimsoll.watcher.run import EventLog, Timing, Watcher
from plimsoll.watcher.sysctl import Applied, CeilingMismatch

pytestmark = pytest.mark.pure

T = Targets(standalone_mib=48 * 1024, clustered_mib=80 * 1024)
SMALL = 10 * GIB  # memory in use that fits both envelopes


def ok(mode, **kw):
    return ProxyAnswer(mode, "ok", http_status=200, proxy_mode=mode, fits=True, **kw)


def refused(mode):
    other = "clustered" if mode == "standalone" else "standalone"
    return ProxyAnswer(mode, "refused", http_status=409, proxy_mode=other, fits=False,
                       in_use_bytes=60 * GIB, envelope_bytes=48 * GIB, detail="no room")


def obs(up, ceiling, in_use=SMALL, proxy=True, proxy_mode=None, answer=None):
    return Observation(up, ceiling, in_use, proxy, proxy_mode, answer)


# --- the table -------------------------------------------------------------------------


def test_targets_are_exact_mib_of_the_gib_budgets():
    from plimsoll.core.policy import parse_policy

    pol = parse_policy({"schemaVersion": 1, "host": "m", "totalRamGb": 96, "osFloorGb": 8,
                        "modes": {"standalone": {"maxLocalLlmGb": 72},
                                  "clustered": {"maxLocalLlmGb": 86.5}}})
    t = Targets.from_policy(pol)
    assert (t.standalone_mib, t.clustered_mib) == (72 * 1024, 88576)  # 86.5 × 1024 exact
    assert t.mib("clustered") * MIB == pol.budget_bytes("clustered")


def test_upshift_raises_then_verifies_then_tells_the_proxy():
    a = decide(obs(True, T.standalone_mib, proxy_mode="standalone"), T)
    assert a == WriteCeiling("clustered", T.clustered_mib, "raise", a.reason)
    a = decide(obs(True, T.clustered_mib, proxy_mode="standalone"), T)
    assert isinstance(a, TellProxy) and a.mode == "clustered"
    a = decide(obs(True, T.clustered_mib, answer=ok("clustered")), T)
    assert isinstance(a, Hold) and a.mode == "clustered"


def test_downshift_tells_the_proxy_first_and_lowers_only_after_it_confirms():
    a = decide(obs(False, T.clustered_mib, proxy_mode="clustered"), T)
    assert isinstance(a, TellProxy) and a.mode == "standalone"
    # The proxy's mode alone (e.g. from GET) is not a confirmation that memory fits.
    a = decide(obs(False, T.clustered_mib, proxy_mode="standalone"), T)
    assert isinstance(a, TellProxy)
    a = decide(obs(False, T.clustered_mib, answer=ok("standalone")), T)
    assert a == WriteCeiling("standalone", T.standalone_mib, "lower", a.reason)
    a = decide(obs(False, T.standalone_mib, answer=ok("standalone")), T)
    assert isinstance(a, Hold) and a.mode == "standalone"


def test_proxy_409_keeps_the_higher_ceiling_and_retries():
    a = decide(obs(False, T.clustered_mib, answer=refused("standalone")), T)
    assert isinstance(a, Retry)
    assert "409" in a.reason and "keeping the current ceiling" in a.reason
    for status in ("timeout", "unreachable", "unauthorized", "rejected"):
        a = decide(obs(False, T.clustered_mib, answer=ProxyAnswer("standalone", status)), T)
        assert isinstance(a, Retry), status


def test_a_200_that_does_not_fit_is_not_a_confirmation():
    bad = ProxyAnswer("standalone", "ok", http_status=200, proxy_mode="standalone", fits=False)
    assert not bad.ok
    assert isinstance(decide(obs(False, T.clustered_mib, answer=bad), T), Retry)


def test_an_answer_for_the_other_mode_is_ignored():
    a = decide(obs(False, T.clustered_mib, answer=ok("clustered")), T)
    assert isinstance(a, TellProxy) and a.mode == "standalone"


def test_never_writes_below_in_use():
    # The proxy said it fits, but the probe disagrees: hold the higher ceiling.
    a = decide(obs(False, T.clustered_mib, in_use=49 * GIB, answer=ok("standalone")), T)
    assert isinstance(a, Retry) and "below the memory in use" in a.reason
    # Even a raise is refused if the target itself is below what is in use.
    a = decide(obs(True, T.standalone_mib, in_use=81 * GIB), T)
    assert isinstance(a, Retry)
    assert check_write(T.standalone_mib, T.standalone_mib * MIB) is None  # equal is fine
    assert check_write(T.standalone_mib, T.standalone_mib * MIB + 1) is not None


def test_without_a_proxy_the_ceiling_alone_follows_the_link():
    assert isinstance(decide(obs(False, T.clustered_mib, proxy=False), T), WriteCeiling)
    assert isinstance(decide(obs(True, T.standalone_mib, proxy=False), T), WriteCeiling)
    assert isinstance(decide(obs(True, T.clustered_mib, proxy=False), T), Hold)


@pytest.mark.parametrize("unknown", [None, 0])
def test_unknown_ceiling_uses_the_safe_order_of_the_mode(unknown):
    up = decide(obs(True, unknown), T)
    assert isinstance(up, WriteCeiling) and up.direction == "raise"
    down = decide(obs(False, unknown), T)
    assert isinstance(down, TellProxy) and down.mode == "standalone"


def test_a_proxy_restarted_in_the_wrong_mode_is_told_again():
    a = decide(obs(True, T.clustered_mib, proxy_mode="standalone"), T)
    assert isinstance(a, TellProxy) and a.mode == "clustered"
    # ...even with an earlier confirmation remembered: the observed mode wins.
    a = decide(obs(True, T.clustered_mib, proxy_mode="standalone", answer=ok("clustered")), T)
    assert isinstance(a, TellProxy) and a.mode == "clustered"


def test_a_ceiling_above_the_clustered_budget_is_lowered_after_the_proxy_confirms():
    high = T.clustered_mib + 1024
    assert isinstance(decide(obs(True, high, proxy_mode="clustered"), T), TellProxy)
    a = decide(obs(True, high, answer=ok("clustered")), T)
    assert isinstance(a, WriteCeiling) and a.direction == "lower"


# --- properties ------------------------------------------------------------------------

modes = st.sampled_from(["standalone", "clustered"])
answers = st.one_of(st.none(), st.builds(
    ProxyAnswer, mode=modes,
    status=st.sampled_from(["ok", "refused", "timeout", "unreachable", "unauthorized"]),
    proxy_mode=st.one_of(st.none(), modes), fits=st.one_of(st.none(), st.booleans())))
observations = st.builds(
    Observation, link_up=st.booleans(),
    ceiling_mib=st.one_of(st.none(), st.just(0), st.sampled_from(
        [T.standalone_mib, T.clustered_mib]), st.integers(1, 200 * 1024)),
    in_use_bytes=st.integers(0, 200 * GIB), proxy=st.booleans(),
    proxy_mode=st.one_of(st.none(), modes), answer=answers)


@given(observations)
def test_property_every_write_is_at_least_in_use_and_the_mode_budget(o):
    a = decide(o, T)
    if isinstance(a, WriteCeiling):
        assert a.mib * MIB >= o.in_use_bytes
        assert a.mib == T.mib("clustered" if o.link_up else "standalone")


@given(observations)
def test_property_a_lowering_with_a_proxy_needs_its_confirmation(o):
    a = decide(o, T)
    if isinstance(a, WriteCeiling) and a.direction == "lower" and o.proxy:
        assert o.answer is not None and o.answer.ok and o.answer.mode == a.mode


@given(observations)
def test_property_the_proxy_hears_clustered_only_over_a_ceiling_that_holds_it(o):
    a = decide(o, T)
    if isinstance(a, TellProxy) and a.mode == "clustered":
        assert o.ceiling_mib is not None and o.ceiling_mib >= T.clustered_mib


@given(observations)
def test_property_hold_means_converged(o):
    a = decide(o, T)
    if isinstance(a, Hold):
        assert o.ceiling_mib == T.mib(a.mode)


# --- debounce and backoff --------------------------------------------------------------


def test_settle_ignores_a_flap_and_follows_a_change_that_holds():
    s = Settle.start(True, 0.0)
    for i in range(20):  # 0.1 s flaps for 2 s: never settles
        s = s.update(i % 2 == 1, i * 0.1, settle_s=1.0)
        assert s.up is True
    s = s.update(False, 2.0, 1.0)
    assert s.up is True and s.remaining(2.5, 1.0) == pytest.approx(0.5)
    s = s.update(False, 3.0, 1.0)
    assert s.up is False and s.remaining(3.0, 1.0) is None


def test_settle_zero_follows_at_once():
    assert Settle.start(True, 0).update(False, 0.0, 0.0).up is False


def test_backoff_doubles_up_to_the_cap():
    assert [backoff_delay(i, 1.0, 10.0) for i in range(6)] == [1, 2, 4, 8, 10, 10]
    assert backoff_delay(10_000, 1.0, 30.0) == 30.0


# --- the loop on fakes -----------------------------------------------------------------


class World:
    """A fake clock, link, ceiling, memory probe and proxy that record one ordered trace."""

    def __init__(self, script, *, ceiling=None, in_use=SMALL, proxy_script=None,
                 end=20.0, mismatch=False):
        self.now, self.script, self.end = 0.0, script, end
        self.ceiling, self.in_use_value, self.mismatch = ceiling, in_use, mismatch
        self.proxy_mode, self.proxy_script = "standalone", list(proxy_script or [])
        self.trace: list[tuple] = []
        self.stop = threading.Event()
        self.interface, self.name, self.url = "veth0", "fake", "http://127.0.0.1:1"

    # link
    def read(self):
        up = [u for t, u in self.script if t <= self.now][-1]
        return LinkState(up, f"t={self.now:.2f}")

    def wait(self, timeout):
        self.now += max(timeout, 0.01)
        if self.now >= self.end:
            self.stop.set()

    def close(self):
        pass

    # ceiling
    def read_mib(self):
        return self.ceiling

    def write_mib(self, mib):
        self.trace.append((round(self.now, 2), "write", mib, self.in_use_value))
        self.ceiling = mib + 1 if self.mismatch else mib
        if self.mismatch:
            raise CeilingMismatch(f"wrote {mib} read back {mib + 1}")
        return Applied(mib, mib, None, "fake")

    # memory
    def in_use(self):
        return self.in_use_value

    # proxy
    def set_mode(self, mode):
        status = self.proxy_script.pop(0) if self.proxy_script else 200
        self.trace.append((round(self.now, 2), "post", mode, status))
        if status == 200:
            self.proxy_mode = mode
            return ok(mode)
        return refused(mode)

    def get_mode(self):
        return self.proxy_mode


def run_world(w, once=False, proxy=True, settle=1.0):
    out = io.StringIO()
    watcher = Watcher(targets=T, link=w, ceiling=w, in_use=w.in_use,
                      proxy=w if proxy else None, log=EventLog(out, clock=lambda: w.now),
                      timing=Timing(poll_s=0.5, settle_s=settle, backoff_base_s=1.0,
                                    backoff_cap_s=4.0, proxy_check_s=5.0),
                      clock=lambda: w.now)
    code = watcher.run(w.stop, once=once)
    return code, [parse_log_line(line) for line in out.getvalue().splitlines()]


def test_loop_orders_upshift_and_downshift():
    w = World([(0, False), (2.0, True), (6.0, False)], ceiling=T.standalone_mib)
    run_world(w)
    kinds = [(k, v) for _, k, v, _ in w.trace]
    assert kinds == [("write", T.clustered_mib), ("post", "clustered"),  # up: raise first
                     ("post", "standalone"), ("write", T.standalone_mib)]  # down: proxy first
    t_up = next(t for t, k, v, _ in w.trace if v == T.clustered_mib)
    t_down = next(t for t, k, v, _ in w.trace if v == T.standalone_mib)
    assert 3.0 <= t_up <= 3.6 and 7.0 <= t_down <= 7.6  # settle 1 s, then at once


def test_loop_start_is_idempotent_when_already_converged():
    w = World([(0, True)], ceiling=T.clustered_mib)
    w.proxy_mode = "clustered"
    code, log = run_world(w, once=True)
    assert code == 0 and w.trace == []
    assert [r["event"] for r in log] == ["link", "converged"]


def test_loop_keeps_the_higher_ceiling_on_409_and_retries_with_backoff():
    w = World([(0, True), (1.0, False)], ceiling=T.clustered_mib,
              proxy_script=[409, 409, 409, 200], end=30)
    w.proxy_mode = "clustered"
    _, log = run_world(w)
    posts = [t for t, k, _, _ in w.trace if k == "post"]
    writes = [(t, v) for t, k, v, _ in w.trace if k == "write"]
    assert len(posts) == 4 and writes == [(writes[0][0], T.standalone_mib)]
    assert writes[0][0] >= posts[-1]  # lowered only after the 200
    gaps = [round(b - a, 1) for a, b in itertools.pairwise(posts)]
    assert gaps[0] >= 1.0 and gaps[1] >= 2.0 and gaps[2] >= 4.0  # backoff 1, 2, 4
    held = [r for r in log if r["event"] == "held"]
    assert len(held) == 3 and all(r["level"] == "ERROR" for r in held)


def test_loop_rechecks_in_use_right_before_writing():
    w = World([(0, False)], ceiling=T.clustered_mib, end=3)
    calls = {"n": 0}

    def rising():  # fits when decide looks, over the target when the write re-checks
        calls["n"] += 1
        return SMALL if calls["n"] % 2 else 60 * GIB

    w.in_use = rising
    _, log = run_world(w, proxy=False)
    assert [k for _, k, _, _ in w.trace] == []
    assert any(r["event"] == "held" and "below the memory in use" in r["msg"] for r in log)


def test_loop_treats_a_read_back_mismatch_as_an_error_and_does_not_tell_the_proxy():
    w = World([(0, True)], ceiling=T.standalone_mib, mismatch=True)
    code, log = run_world(w, once=True)
    assert code == 1
    assert [k for _, k, _, _ in w.trace] == ["write"]  # no POST clustered after a bad raise
    err = [r for r in log if r["event"] == "ceiling-error"]
    assert err and err[0]["level"] == "ERROR" and "read back" in err[0]["msg"]


def test_loop_retells_a_proxy_that_came_back_in_another_mode():
    w = World([(0, True)], ceiling=T.clustered_mib, end=14)
    w.proxy_mode = "clustered"
    orig_wait = w.wait

    def wait(timeout):  # the proxy restarts (in standalone) at t = 3 s
        orig_wait(timeout)
        if 3.0 <= w.now < 3.0 + max(timeout, 0.01):
            w.proxy_mode = "standalone"

    w.wait = wait
    _, log = run_world(w)
    posts = [(t, v) for t, k, v, _ in w.trace if k == "post"]
    assert [v for _, v in posts] == ["clustered"] and 3.0 < posts[0][0] <= 3.0 + 5.5
    assert any(r["event"] == "proxy-mode" for r in log)
    assert w.trace[0][1] == "post"  # no ceiling write: it was already right


def test_log_lines_round_trip():
    out = io.StringIO()
    EventLog(out, clock=lambda: 1.5).emit("INFO", "x", a=1, b="two words", c=None,
                                          msg='say "hi"')
    rec = parse_log_line(out.getvalue())
    assert rec == {"time": "1970-01-01T00:00:01.500000Z", "level": "INFO", "event": "x",
                   "a": "1", "b": "two words", "c": "None", "ts": "1.500000",
                   "msg": 'say "hi"'}
