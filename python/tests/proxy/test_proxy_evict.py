"""The proxy's pure core: eviction choice, envelope, right-sized pools, release checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plimsoll.cli.common import UsageFailure
from plimsoll.cli.serve import parse_idle_ttls
from plimsoll.core.admission import AdmissionRequest, admit
from plimsoll.core.sizing import (
    RELEASE_TOLERANCE_FLOOR,
    ReleaseCheck,
    envelope_bytes,
    release_tolerance,
    right_size,
)
from plimsoll.core.units import GIB, MIB
from plimsoll.probes.held import parse_rss_anon
from plimsoll.proxy.evict import Resident, choose_evictions, eviction_order
from plimsoll.proxy.state import TRANSITIONS, State

pytestmark = pytest.mark.pure


def r(name, admitted, observed=0, last_used=0.0, busy=False):
    return Resident(name, admitted, observed, last_used, busy)


def test_a_small_model_stays_co_resident_when_it_fits():
    e = choose_evictions(100, [r("a", 300), r("b", 50)], 512)
    assert e.stop == () and e.fits and e.kept_bytes == 350


def test_a_large_model_evicts_least_recently_used_first_until_it_fits():
    running = [r("old", 200, last_used=1.0), r("new", 200, last_used=5.0),
               r("mid", 100, last_used=3.0)]
    e = choose_evictions(300, running, 512)
    assert e.stop == ("old", "mid") and e.fits and e.kept_bytes == 200


def test_busy_workers_go_last():
    running = [r("busy", 200, last_used=0.0, busy=True), r("idle", 200, last_used=9.0)]
    assert choose_evictions(300, running, 512).stop == ("idle",)
    assert [x.name for x in eviction_order(running)] == ["idle", "busy"]


def test_observed_memory_counts_when_larger_than_admitted():
    # admitted 50 but the process really holds 400: it must go for a 200-byte target
    e = choose_evictions(200, [r("a", 50, observed=400)], 512)
    assert e.stop == ("a",)


def test_a_target_larger_than_the_envelope_stops_nothing():
    e = choose_evictions(600, [r("a", 100)], 512)
    assert e.stop == () and not e.fits


def test_a_downshift_is_a_zero_target():
    e = choose_evictions(0, [r("a", 300, last_used=1), r("b", 300, last_used=2)], 512)
    assert e.stop == ("a",) and e.fits


@given(target=st.integers(0, 2000), envelope=st.integers(1, 2000),
       sizes=st.lists(st.tuples(st.integers(0, 800), st.integers(0, 800), st.floats(0, 100),
                                st.booleans()), max_size=6))
def test_eviction_is_minimal_in_its_order(target, envelope, sizes):
    running = [r(f"w{i}", a, o, t, b) for i, (a, o, t, b) in enumerate(sizes)]
    e = choose_evictions(target, running, envelope)
    kept = [x for x in running if x.name not in e.stop]
    assert e.kept_bytes == sum(x.bytes for x in kept)
    if target > envelope:
        assert e.stop == () and not e.fits
        return
    assert e.fits == (target + e.kept_bytes <= envelope)
    order = [x.name for x in eviction_order(running)]
    assert list(e.stop) == order[:len(e.stop)]  # a prefix of the order...
    if e.stop:  # ...and no shorter prefix would have done
        before_last = e.kept_bytes + next(x.bytes for x in running if x.name == e.stop[-1])
        assert target + before_last > envelope
    assert e.fits or not kept  # it only fails to fit when everyone is stopped


def _req(**kw):
    base = dict(ceiling_bytes=24 * GIB, total_ram_bytes=24 * GIB, budget_bytes=GIB // 2,
                weights_bytes=16 * MIB, kv_bytes_per_token=2048, transient_reserve=0.05,
                block_tokens=16, concurrency=4, context=32768, max_tokens=1024)
    return AdmissionRequest(**{**base, **kw})


@pytest.mark.parametrize("budget", [GIB // 2, 64 * GIB])
def test_envelope_is_what_admission_fills(budget):
    req = _req(budget_bytes=budget, ceiling_bytes=20 * GIB)
    dec = admit(req)
    env = envelope_bytes(req.ceiling_bytes, req.total_ram_bytes, budget, req.trip_offset,
                         req.u_margin)
    assert dec.footprint_bytes <= env < dec.footprint_bytes + dec.block_bytes


def test_right_size_caps_the_pool_at_what_the_sequences_use():
    dec = admit(_req())
    small = right_size(dec)
    need = 4 * dec.blocks_per_seq  # no moves, so no headroom (the worker checks the same)
    assert small.pool_blocks == need < dec.pool_blocks
    assert small.footprint_bytes == (dec.weights_bytes + dec.transient_reserve_bytes
                                     + need * dec.block_bytes)
    assert small.concurrency == dec.concurrency and small.context == dec.context
    assert "right-sized" in small.reasons[-1]
    # two such workers no longer claim a whole envelope each
    assert 2 * small.footprint_bytes < 2 * dec.footprint_bytes


def test_right_size_never_grows_a_clamped_pool_and_passes_a_refusal():
    clamped = admit(_req(budget_bytes=64 * MIB, concurrency=64))
    assert clamped.decision == "clamp"
    assert right_size(clamped).pool_blocks <= clamped.pool_blocks
    refused = admit(_req(budget_bytes=8 * MIB))
    assert right_size(refused) is refused


def test_right_sized_pool_passes_the_workers_own_check():
    from plimsoll.core.sizing import pool_problem

    small = right_size(admit(_req()))
    assert pool_problem(small.pool_blocks, small.context, small.block_tokens,
                        small.fixed_blocks_per_seq, small.concurrency) is None
    assert pool_problem(small.pool_blocks - 1, small.context, small.block_tokens,
                        small.fixed_blocks_per_seq, small.concurrency) is not None


def test_release_check_and_tolerance():
    assert release_tolerance(10 * MIB, 20 * MIB) == RELEASE_TOLERANCE_FLOOR
    assert release_tolerance(10 * GIB, GIB) == GIB
    c = ReleaseCheck("a", 42, before_bytes=10 * GIB, held_bytes=2 * GIB,
                     tolerance_bytes=100 * MIB)
    assert c.released(8 * GIB + 100 * MIB) and not c.released(8 * GIB + 101 * MIB)
    assert "not verified released" in c.describe(9 * GIB)
    assert c.figures(9 * GIB)["target_bytes"] == 8 * GIB + 100 * MIB


def test_rss_anon_parsing():
    assert parse_rss_anon("VmRSS:\t 1000 kB\nRssAnon:\t  300 kB\n") == 300 * 1024
    assert parse_rss_anon("VmRSS:\t 1000 kB\n") is None  # Linux < 4.5


def test_state_machine_draws_only_the_documented_transitions():
    assert TRANSITIONS[State.STOPPED] == {State.STARTING}
    assert TRANSITIONS[State.STARTING] == {State.READY, State.STOPPED}
    assert TRANSITIONS[State.READY] == {State.STOPPING}
    assert TRANSITIONS[State.STOPPING] == {State.STOPPED}


def test_idle_ttl_flags():
    assert parse_idle_ttls(("600", "a=2.5"), {"a", "b"}) == (600.0, (("a", 2.5),))
    assert parse_idle_ttls((), {"a"}) == (300.0, ())
    for bad in ("x", "-1", "zzz=3", "nan", "a=inf"):
        with pytest.raises(UsageFailure):
            parse_idle_ttls((bad,), {"a"})


def test_an_unverified_release_refuses_the_next_load_with_the_figures():
    """The edge around the pure check: polled, recorded, pending until memory comes back."""
    import asyncio

    from plimsoll.core.policy import parse_policy
    from plimsoll.probes.snapshot import MemorySnapshot
    from plimsoll.proxy.supervisor import ProxyError, Settings, Supervisor

    in_use = [5 * GIB]

    def snap(pid=None):
        return MemorySnapshot(platform="override", total_ram_bytes=16 * GIB,
                              ceiling_bytes=16 * GIB, ceiling_source="test",
                              in_use_bytes=in_use[0], process_footprint_bytes=0)

    pol = parse_policy({"schemaVersion": 1, "host": "t", "totalRamGb": 16, "osFloorGb": 4,
                        "modes": {"standalone": {"maxLocalLlmGb": 8},
                                  "clustered": {"maxLocalLlmGb": 8}}})
    check = ReleaseCheck("a", 4242, before_bytes=5 * GIB, held_bytes=GIB,
                         tolerance_bytes=RELEASE_TOLERANCE_FLOOR)

    async def scenario():
        sup = Supervisor(pol, "standalone", Settings(release_timeout_s=0.2), read_snapshot=snap)
        assert not await sup.verify(check)  # still 5 GiB in use: not released
        assert sup.pending == [check]
        with pytest.raises(ProxyError) as exc:
            await sup.settle_releases()
        assert exc.value.status == 503 and exc.value.code == "release_unverified"
        assert exc.value.extra["release"]["target_bytes"] == 4 * GIB + RELEASE_TOLERANCE_FLOOR
        in_use[0] = 4 * GIB  # the memory came back
        await sup.settle_releases()
        assert sup.pending == []
        return sup.events.kinds("a")

    assert asyncio.run(scenario()) == ["release-unverified", "release-unverified",
                                       "release-verified"]
