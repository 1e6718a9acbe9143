"""The wire between the API process and the engine process: what crosses comes back equal —
requests (their constraint as a spec), every kind of event, a status snapshot — and the
streaming decoder cuts a byte stream into whole messages wherever it is split."""

from __future__ import annotations

import collections
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plimsoll import constrain
from plimsoll.worker import ipc
from plimsoll.worker.events import (
    Finished,
    GenRequest,
    Refused,
    SchedulerLimits,
    Started,
    Token,
)
from plimsoll.worker.pool import BlockPool
from plimsoll.worker.stats import status_figures

pytestmark = pytest.mark.pure

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=20)


def through(msg):
    """``msg`` packed, fed to a fresh decoder in two pieces, decoded."""
    data = ipc.pack(msg)
    decoder = ipc.unpacker()
    decoder.feed(data[: len(data) // 2])
    assert list(decoder) == []
    decoder.feed(data[len(data) // 2:])
    (got,) = list(decoder)
    return got


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50),
       max_tokens=st.integers(1, 10**6), temperature=st.floats(0, 2), top_p=st.floats(0, 1),
       seed=st.none() | st.integers(0, 2**32), ignore_eos=st.booleans(),
       schema=st.none() | st.dictionaries(st.text(max_size=5), json_values, max_size=3),
       tools=st.lists(st.tuples(st.text(min_size=1, max_size=5),
                                st.dictionaries(st.text(max_size=5), json_values, max_size=2)),
                      max_size=2))
def test_a_request_crosses_as_data(prompt, max_tokens, temperature, top_p, seed, ignore_eos,
                                   schema, tools):
    spec = None if schema is None else constrain.Spec("json", schema, tuple(tools))
    sent = GenRequest(prompt=prompt, max_tokens=max_tokens, sink=lambda ev: None,
                      temperature=temperature, top_p=top_p, seed=seed,
                      ignore_eos=ignore_eos, spec=spec)
    got = ipc.gen_request(through(ipc.gen_message(sent)), sink=print)
    assert (got.id, got.prompt, got.max_tokens, got.temperature, got.top_p, got.seed,
            got.ignore_eos, got.spec) == (sent.id, prompt, max_tokens, temperature, top_p,
                                          seed, ignore_eos, spec)
    assert got.constraint is None and got.sink is print


EVENTS = st.one_of(
    st.builds(Token, st.integers(0, 2**31)),
    st.builds(Started, st.integers(0, 10**6), st.integers(0, 10**6)),
    st.builds(Finished, st.sampled_from(["length", "eos", "stop", "cancelled"]),
              st.integers(0, 10**6)),
    st.builds(Refused, st.sampled_from([400, 500, 503]), st.text(max_size=40),
              st.text(max_size=12), st.none() | st.integers(0, 60)))


@settings(max_examples=150, deadline=None)
@given(events=st.lists(st.tuples(st.integers(0, 2**40), EVENTS), max_size=40))
def test_a_pass_of_events_crosses_in_order(events):
    tag, items = through([ipc.EVENTS, [ipc.event_item(i, ev) for i, ev in events]])
    assert tag == ipc.EVENTS
    assert [(item[1], ipc.event_of(item)) for item in items] == events
    assert [item[0] in ipc.TERMINAL for item in items] == [
        isinstance(ev, Finished | Refused) for _, ev in events]


class _Engine:
    block_bytes = 32768

    @staticmethod
    def state_bytes_held() -> int:
        return 0


def test_a_status_snapshot_crosses_unchanged():
    pool = BlockPool(total=64, block_tokens=16, cache_cap_blocks=32, extra_key=b"t")
    grant = pool.can_allocate(list(range(40)), 8, pool.prompt_hashes(list(range(40))))
    pool.allocate(1, grant)
    pool.grow(1, 40)
    counters = collections.Counter({"admitted": 3, "refused_pool_exhausted": 1, "eos": 2})
    limits = SchedulerLimits(8, 16, 30.0, 1 << 40)
    snap = status_figures(pool, _Engine(), [], 2, limits, counters, 17, "", None, 1 << 20,
                          1 << 21)
    figures = {"stats": snap, "tripped": "", "memory": {"active": 5, "peak": 7, "cache": 0},
               "rss": 123, "guard": None, "cgroup": None}
    tag, qid, got = through([ipc.FIGURES, 9, figures])
    assert (tag, qid) == (ipc.FIGURES, 9)
    assert got == json.loads(json.dumps(figures))  # tuples arrive as lists, as JSON sends them
    assert json.dumps(got, sort_keys=True) == json.dumps(figures, sort_keys=True)


@settings(max_examples=100, deadline=None)
@given(messages=st.lists(json_values, min_size=1, max_size=8),
       cuts=st.lists(st.integers(0, 400), max_size=6))
def test_the_decoder_cuts_a_stream_into_messages_wherever_it_is_split(messages, cuts):
    data = b"".join(ipc.pack([ipc.EVENTS, m]) for m in messages)
    decoder, got, at = ipc.unpacker(), [], 0
    for cut in [*sorted(c for c in cuts if c < len(data)), len(data)]:
        decoder.feed(data[at:cut])
        at = cut
        got += list(decoder)
    assert got == [[ipc.EVENTS, m] for m in messages]


def test_stop_reading_ends_a_blocked_read_and_sending_still_works():
    """The engine process's SIGTERM: the read loop ends as at the end of input even where the
    handler's exception is swallowed, and the last events still go out."""
    import socket
    import threading

    ours, theirs = socket.socketpair()
    channel = ipc.BlockingChannel(ours)
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(channel.messages()), daemon=True)
    reader.start()
    theirs.sendall(ipc.pack([ipc.CANCEL, 7]))
    reader.join(0.3)
    assert reader.is_alive()  # blocked in its next read
    channel.stop_reading()
    reader.join(5)
    assert not reader.is_alive() and got == [[ipc.CANCEL, 7]]
    channel.send([ipc.EVENTS, []])
    decoder = ipc.unpacker()
    decoder.feed(theirs.recv(1 << 16))
    assert list(decoder) == [[ipc.EVENTS, []]]
    channel.close()
    theirs.close()
