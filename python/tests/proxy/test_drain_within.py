"""Drain.within: the bound on a relayed read: its result while no shutdown has begun, the
default (the read cancelled) at the drain's end, even for a read that began before it."""

from __future__ import annotations

import asyncio
import time

import pytest

from plimsoll.web.graceful import Drain

pytestmark = pytest.mark.pure

GONE = object()


async def _result_after(s: float, value: object) -> object:
    await asyncio.sleep(s)
    return value


def test_a_wait_with_no_shutdown_returns_its_result_and_leaves_nothing_behind():
    async def main():
        drain = Drain(0.05)
        got = await drain.within(_result_after(0.1, "chunk"), GONE)  # longer than drain_s
        assert got == "chunk"
        assert not drain._bounded

    asyncio.run(main())


def test_a_drain_that_begins_mid_wait_ends_it_at_the_drain_time_and_cancels_the_read():
    async def main():
        drain = Drain(0.2)
        cancelled = asyncio.Event()

        async def never() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        loop = asyncio.get_running_loop()
        loop.call_later(0.1, drain.begin)  # while the read waits, with no deadline yet
        t0 = time.monotonic()
        got = await asyncio.wait_for(drain.within(never(), GONE), 5)  # a failure, not a hang
        waited = time.monotonic() - t0
        assert got is GONE
        assert cancelled.is_set()
        assert 0.25 <= waited < 1.0, waited  # 0.1 s to the begin + the 0.2 s drain
        assert not drain._bounded

    asyncio.run(main())


def test_a_wait_after_the_drain_ran_out_ends_at_once_and_one_within_it_finishes():
    async def main():
        drain = Drain(0.3)
        drain.begin()
        assert await drain.within(_result_after(0.01, "quick"), GONE) == "quick"
        assert await drain.within(_result_after(5, "slow"), GONE) is GONE
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        assert await drain.within(_result_after(5, "late"), GONE) is GONE
        assert time.monotonic() - t0 < 1.0  # at once, not the 5 s of the awaited work

    asyncio.run(main())


def test_a_timeout_raised_by_the_read_itself_is_not_taken_for_the_drain():
    async def main():
        drain = Drain(5)

        async def times_out() -> None:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(1)

        with pytest.raises(TimeoutError):
            await drain.within(times_out(), GONE)

    asyncio.run(main())
