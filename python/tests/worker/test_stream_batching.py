"""The worker's streaming hot path: text chunks rendered from a per-response template are the
chunks the protocol builders make, byte for byte; the mailbox delivers every event of a
burst, in order, with one wake-up of the loop; the decode's kept table index reads what a
fresh build reads."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plimsoll import protocol as P
from plimsoll.worker.app import TextSSE
from plimsoll.worker.submit import Mailbox

pytestmark = pytest.mark.pure


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["chat", "completion"]), model=st.text(max_size=20),
       texts=st.lists(st.text(max_size=12), max_size=4))
def test_text_template_is_the_protocol_chunk_byte_for_byte(kind, model, texts):
    meta = P.ResponseMeta.new(kind, model)
    deltas = [P.TextDelta(t) for t in texts]
    want = b"".join(P.sse(c) for c in P.delta_chunks(meta, deltas))
    assert TextSSE(meta).deltas(meta, deltas) == want


def test_non_text_deltas_are_built_by_the_protocol():
    meta = P.ResponseMeta.new("chat", "m")
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    deltas = [P.TextDelta("a"), P.ReasoningDelta("why"), P.ToolCallDelta(0, call)]
    want = b"".join(P.sse(c) for c in P.delta_chunks(meta, deltas))
    assert TextSSE(meta).deltas(meta, deltas) == want


def test_mailbox_delivers_a_burst_in_order_with_one_wake_up():
    async def main() -> tuple[list, list, int]:
        loop = asyncio.get_running_loop()
        box = Mailbox(loop)
        wakes = 0
        flush = box._flush

        def counted() -> None:
            nonlocal wakes
            wakes += 1
            flush()

        box._flush = counted
        qa, qb = asyncio.Queue(), asyncio.Queue()
        sa, sb = box.sink(qa), box.sink(qb)

        def burst() -> None:  # the scheduler thread: one step's tokens for two requests
            for i in range(50):
                sa(("a", i))
                sb(("b", i))

        t = threading.Thread(target=burst)
        t.start()
        t.join()
        got_a = [await asyncio.wait_for(qa.get(), 5) for _ in range(50)]
        got_b = [await asyncio.wait_for(qb.get(), 5) for _ in range(50)]
        return got_a, got_b, wakes

    got_a, got_b, wakes = asyncio.run(main())
    assert got_a == [("a", i) for i in range(50)] and got_b == [("b", i) for i in range(50)]
    assert wakes == 1  # posted while the loop was blocked: one flush took all of them


@pytest.mark.impure
@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 5), consecutive=st.booleans())
def test_kept_decode_index_reads_what_a_fresh_build_reads(data, rows, consecutive):
    import numpy as np

    from plimsoll.engine.decode_index import DecodeReads
    from plimsoll.engine.paged import read_of

    bt = 4
    free = list(range(400))
    if not consecutive:
        free = data.draw(st.permutations(free))
    tables: list[list[int]] = [[] for _ in range(rows)]
    lengths = [data.draw(st.integers(1, 30)) for _ in range(rows)]
    reads = DecodeReads(bt)
    ids = tuple(range(rows))
    for _ in range(data.draw(st.integers(1, 40))):
        for r in range(rows):
            while len(tables[r]) * bt < lengths[r]:
                tables[r].append(free.pop(0))
        frozen = [tuple(t) for t in tables]
        got, top = reads.read(ids, frozen, lengths)
        want = read_of(frozen, lengths, bt)
        assert got.span == want.span
        if want.index is not None:
            assert got.length == want.length
            assert np.array_equal(np.array(got.index), np.array(want.index))
        assert top >= max(b for t, n in zip(frozen, lengths, strict=True)
                          for b in t[:-(-n // bt)])
        lengths = [n + data.draw(st.integers(0, 3)) for n in lengths]
