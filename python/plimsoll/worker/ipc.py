"""The wire between the worker's API process and its engine process: messages and channels.

Transport: one Unix stream socket pair, made by the API process; the engine's end is an
inherited file descriptor (:mod:`.engine_proc`). Codec and framing: msgpack, whose streaming
``Unpacker`` cuts the byte stream into messages, so nothing here counts lengths. Each message
is a msgpack array whose first item is a tag below.

Why a socket pair and msgpack, measured on this CPU (2 cores shared with other jobs, load
~5; the round trip of one pass's message of 32 rows' token ids, 261 bytes, echoed by a
spawned process; ``bench/ipc.py``, ``bench/results/ipc-cpu-2026-12-01.md``):

- a socket pair, msgpack's ``Unpacker`` as framing: 33 µs median (27-55 over the rounds);
  a peer that dies is an EOF on the other end at once; a stdlib transport;
- pyzmq ``PAIR`` over ``ipc://``, msgpack: 132 µs median (125-285; 36-63 in a quieter run);
  atomic messages, but a peer that dies is silence (a monitor socket or a pid watch would
  be needed), and a native library more.

Codec alone (encode + decode of that message): msgpack 13-25 µs, msgspec 7-11 µs; msgspec
has no streaming decoder, so it would need framing of its own. All of these are far under a
decode step (≥ 2 ms for the tiny demo on this CPU, ~14 ms for a 4B model at 32 rows on an
H200). The socket pair is the faster here and gives for nothing what matters most: the EOF.
The engine process sees its API process go (a crash, a SIGKILL) as the end of its input and
exits, so it is never orphaned holding memory; the API process sees the engine go the same
way and ends every open request with the protocol's error event. The kernel orders the
bytes and is the backpressure (a blocked send waits for the reader).

One message per scheduler pass from the engine (every event of the pass: each running
row's new token, starts, finishes, refusals), one per request and one per cancellation
from the API. What crosses is data only: token ids, sampling figures, the constraint as its
:class:`~plimsoll.constrain.Spec` (the engine builds the matcher), events as tuples.

API → engine: ``CONFIG`` (the worker's settings as JSON, whether the tokenizer is wanted),
``GEN`` (one request), ``CANCEL`` (a request id), ``STATUS`` (a query id).
Engine → API: ``READY`` (the loaded engine's figures, the pickled tokenizer or None),
``FAILED`` (why loading failed), ``EVENTS`` (one pass's events), ``FIGURES`` (a query's
answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from plimsoll import constrain

from .events import Event, Finished, GenRequest, Refused, Started, Token

CONFIG, GEN, CANCEL, STATUS = 1, 2, 3, 4
READY, FAILED, EVENTS, FIGURES = 11, 12, 13, 14
#: Event tags inside an ``EVENTS`` message: ``[tag, request id, fields…]``.
EV_TOKEN, EV_STARTED, EV_FINISHED, EV_REFUSED = 0, 1, 2, 3
#: The largest message either side accepts (a prompt of millions of ids, a tokenizer).
MAX_MESSAGE_BYTES = 1 << 30
RECV_BYTES = 1 << 16

pack = msgpack.Packer(use_bin_type=True).pack


def unpacker() -> msgpack.Unpacker:
    """A streaming decoder: fed bytes as they come, it yields whole messages."""
    return msgpack.Unpacker(raw=False, strict_map_key=False,
                            max_buffer_size=MAX_MESSAGE_BYTES)


# --- requests ----------------------------------------------------------------------------
def spec_to_wire(spec: constrain.Spec | None) -> list | None:
    if spec is None:
        return None
    return [spec.kind, spec.schema, [[name, schema] for name, schema in spec.tools]]


def spec_from_wire(data: list | None) -> constrain.Spec | None:
    if data is None:
        return None
    kind, schema, tools = data
    return constrain.Spec(kind, schema, tuple((name, body) for name, body in tools))


def gen_message(req: GenRequest) -> list:
    """``GEN``: everything the scheduler reads from a request, as data."""
    return [GEN, req.id, req.prompt, req.max_tokens, req.temperature, req.top_p, req.seed,
            req.top_k, req.min_p, req.ignore_eos, spec_to_wire(req.spec)]


def gen_request(msg: list, sink: Callable[[Event], None]) -> GenRequest:
    """The engine side's request of a ``GEN`` message (its constraint not built yet)."""
    _, seq_id, prompt, max_tokens, temperature, top_p, seed, top_k, min_p, ignore_eos, spec = msg
    return GenRequest(prompt=prompt, max_tokens=max_tokens, sink=sink, temperature=temperature,
                      top_p=top_p, seed=seed, top_k=top_k, min_p=min_p, ignore_eos=ignore_eos,
                      spec=spec_from_wire(spec), id=seq_id)


# --- events ------------------------------------------------------------------------------
def event_item(seq_id: int, ev: Event) -> list:
    t = type(ev)
    if t is Token:
        return [EV_TOKEN, seq_id, ev.token_id]
    if t is Started:
        return [EV_STARTED, seq_id, ev.prompt_tokens, ev.cached_tokens]
    if t is Finished:
        return [EV_FINISHED, seq_id, ev.reason, ev.completion_tokens, ev.drafted, ev.accepted]
    return [EV_REFUSED, seq_id, ev.status, ev.message, ev.code, ev.retry_after]


def event_of(item: list) -> Event:
    """The event of an ``EVENTS`` item (``item[1]`` is its request id)."""
    tag = item[0]
    if tag == EV_TOKEN:
        return Token(item[2])
    if tag == EV_STARTED:
        return Started(item[2], item[3])
    if tag == EV_FINISHED:
        return Finished(item[2], item[3], item[4], item[5])
    return Refused(item[2], item[3], item[4], item[5])


TERMINAL = (EV_FINISHED, EV_REFUSED)


# --- the engine's side: a blocking socket, read on one thread, written from two ------------
class BlockingChannel:
    """The engine process's end: :meth:`send` from any thread (one lock keeps messages
    whole), :meth:`messages` on one thread until the API process closes its end."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()

    def send(self, msg: list) -> None:
        data = pack(msg)
        with self._lock:
            self._sock.sendall(data)

    def messages(self) -> Iterator[Any]:
        decoder = unpacker()
        while True:
            try:
                chunk = self._sock.recv(RECV_BYTES)
            except ConnectionResetError:
                return
            if not chunk:
                return
            decoder.feed(chunk)
            yield from decoder

    def stop_reading(self) -> None:
        """End :meth:`messages` as at the end of input (at its next read; a read blocked
        now returns); sending still works. Safe from a signal handler."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RD)

    def close(self) -> None:
        self._sock.close()


# --- the API's side: an asyncio protocol on the event loop ------------------------------
class LoopChannel(asyncio.Protocol):
    """The API process's end, on its event loop: each whole message to ``on_message`` as it
    arrives, ``on_lost`` once when the engine's end closes."""

    def __init__(self, on_message: Callable[[Any], None],
                 on_lost: Callable[[Exception | None], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._decoder = unpacker()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._decoder.feed(data)
        for msg in self._decoder:
            self._on_message(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._on_lost(exc)

    def send(self, msg: list) -> bool:
        """Queue ``msg`` for the engine; False once the connection is gone."""
        if self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(pack(msg))
        return True
