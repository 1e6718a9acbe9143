"""The worker's engine ↔ API wire: round trip of one scheduler pass's message, two transports.

A pass of ``--rows`` decoding rows is one ``EVENTS`` message (``plimsoll.worker.ipc``: a
``[tag, request id, token id]`` item a row). This process sends it, a spawned process
decodes and re-encodes it and sends it back; ``--trips`` round trips per round, ``--rounds``
rounds alternating the candidates (medians and ranges):

- ``socketpair``: a Unix socket pair, msgpack with its streaming ``Unpacker`` as framing
  (what the worker uses);
- ``zmq``: pyzmq ``PAIR`` over ``ipc://``, msgpack (skipped where pyzmq is not installed);
- the codec alone: msgpack and (if installed) msgspec, encode + decode of the message.

Prints the figures and writes ``--out-dir``/``--name``.{json,md}.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time

import msgpack
from plimsoll.worker import ipc

from lib import report


def message(rows: int) -> list:
    return [ipc.EVENTS, [[ipc.EV_TOKEN, 1000 + i, 12345 + i] for i in range(rows)]]


def echo_socket(sock: socket.socket) -> None:
    decoder = ipc.unpacker()
    while chunk := sock.recv(ipc.RECV_BYTES):
        decoder.feed(chunk)
        for msg in decoder:
            sock.sendall(ipc.pack(msg))


def echo_zmq(addr: str) -> None:
    import zmq

    s = zmq.Context().socket(zmq.PAIR)
    s.connect(addr)
    while (data := s.recv()) != b"q":
        s.send(msgpack.packb(msgpack.unpackb(data)))


def socketpair_trip(msg: list, trips: int) -> float:
    ours, theirs = socket.socketpair()
    child = mp.get_context("spawn").Process(target=echo_socket, args=(theirs,))
    child.start()
    theirs.close()
    decoder = ipc.unpacker()

    def trip() -> None:
        ours.sendall(ipc.pack(msg))
        while True:
            for _ in decoder:
                return
            decoder.feed(ours.recv(ipc.RECV_BYTES))

    trip()
    t = time.perf_counter()
    for _ in range(trips):
        trip()
    took = (time.perf_counter() - t) / trips
    ours.close()
    child.join()
    return took


def zmq_trip(msg: list, trips: int) -> float | None:
    try:
        import zmq
    except ImportError:
        return None
    addr = f"ipc://{tempfile.mkdtemp()}/engine"
    s = zmq.Context().socket(zmq.PAIR)
    s.bind(addr)
    child = mp.get_context("spawn").Process(target=echo_zmq, args=(addr,))
    child.start()
    s.send(msgpack.packb(msg))
    s.recv()
    t = time.perf_counter()
    for _ in range(trips):
        s.send(msgpack.packb(msg))
        msgpack.unpackb(s.recv())
    took = (time.perf_counter() - t) / trips
    s.send(b"q")
    child.join()
    return took


def codec(msg: list, n: int) -> dict:
    out = {}
    t = time.perf_counter()
    for _ in range(n):
        msgpack.unpackb(msgpack.packb(msg))
    out["msgpack"] = (time.perf_counter() - t) / n
    try:
        import msgspec
    except ImportError:
        return out
    enc, dec = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode
    t = time.perf_counter()
    for _ in range(n):
        dec(enc(msg))
    out["msgspec"] = (time.perf_counter() - t) / n
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--trips", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    report.output_args(ap, "ipc")
    args = ap.parse_args(argv)
    msg = message(args.rows)
    runs: dict[str, list[float]] = {"socketpair": [], "zmq": []}
    for _ in range(args.rounds):
        runs["socketpair"].append(1e6 * socketpair_trip(msg, args.trips))
        if (z := zmq_trip(msg, args.trips)) is not None:
            runs["zmq"].append(1e6 * z)
    codec_us = {k: 1e6 * v for k, v in codec(msg, 4 * args.trips).items()}
    result = {"name": args.name or report.default_name("ipc"), "rows": args.rows,
              "message_bytes": len(ipc.pack(msg)), "trips": args.trips, "rounds": args.rounds,
              "round_trip_us": {k: {"median": statistics.median(v), "min": min(v),
                                    "max": max(v), "runs": v} for k, v in runs.items() if v},
              "codec_us": codec_us, "command": report.command(), "host": report.host_facts()}

    def markdown(r: dict) -> str:
        rows = [[k, f"{v['median']:.1f}", f"{v['min']:.1f}–{v['max']:.1f}"]
                for k, v in r["round_trip_us"].items()]
        lines = [f"# Engine ↔ API wire: {r['name']}", "", f"Command: `{r['command']}`", "",
                 f"One pass of {r['rows']} rows ({r['message_bytes']} bytes), {r['trips']} round "
                 f"trips × {r['rounds']} rounds. {report.host_line(r['host'])}", ""]
        lines += report.table(["transport", "µs per round trip (median)", "range"], rows)
        lines += ["", "Codec alone, encode + decode: " + ", ".join(
            f"{k} {v:.1f} µs" for k, v in r["codec_us"].items())]
        return "\n".join(lines) + "\n"

    report.write(result, args.out_dir, result["name"], markdown)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
