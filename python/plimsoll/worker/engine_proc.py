"""The worker's engine process: mlx, the block pool, the scheduler and the step loop; no HTTP.

Started by the API process (:mod:`.engine_client`) as ``python -m plimsoll.worker.engine_proc
FD API_PID``, FD being its end of the socket pair (:mod:`.ipc`). It reads the worker's
settings, then starts the scheduler (:func:`.backend.start_scheduler`: the engine loaded,
the process-wide MLX limits set and restored in one place, the pool sized, admission,
reservations and the trip), and answers with the loaded figures and the tokenizer. From
then on:

- the main thread reads the API's messages: a request becomes a ``GenRequest`` (its
  constraint's matcher built here from its spec), a cancellation sets the request's flag, a
  status query is answered at once from the scheduler's published snapshot and the live
  memory figures;
- the scheduler thread runs the loop; a request's sink appends its events to the pass's
  :class:`Outbox`, which the loop flushes once at the end of each pass — one message a
  step for every running row, not one a token.

Lifetime: the end of input — the API process closed its end, or died (a crash, a SIGKILL:
the kernel closes its sockets) — stops the scheduler (the disk tier's clean-stop spill
included) and ends this process with status 0, so it never outlives its API process
holding memory. SIGINT is ignored (a terminal's Ctrl-C reaches the whole process group; the
API process drains first and then closes the socket); SIGTERM stops it the same way. The
footprint guard, where no cgroup binds the worker, counts this process and its API process
and ends this one with its own status (:data:`plimsoll.guard.process.EXIT_FOOTPRINT`),
which the API process passes on as its own exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from typing import Any

from plimsoll.core.worker_config import WorkerConfig
from plimsoll.guard.process import SelfGuard
from plimsoll.web.serve import basic_logging

from . import ipc, tokenizer
from .backend import start_scheduler
from .events import Event, GenRequest, Refused
from .scheduler import Scheduler

log = logging.getLogger("plimsoll.worker")


class Outbox:
    """A pass's events, gathered by the requests' sinks on the scheduler thread and sent
    as one ``EVENTS`` message by :meth:`flush` at the end of the pass."""

    def __init__(self, channel: ipc.BlockingChannel, live: dict[int, GenRequest]) -> None:
        self._channel = channel
        self._live = live  # requests the API still waits on, by id (shared with the reader)
        self._items: list[list] = []
        self.gone = False  # the API process closed its end: nothing more is sent

    def sink(self, seq_id: int):
        items, live = self._items, self._live

        def sink(ev: Event) -> None:
            item = ipc.event_item(seq_id, ev)
            if item[0] in ipc.TERMINAL:
                live.pop(seq_id, None)
            items.append(item)
        return sink

    def flush(self) -> None:
        if not self._items:
            return
        batch = self._items[:]
        self._items.clear()
        if self.gone:
            return
        try:
            self._channel.send([ipc.EVENTS, batch])
        except OSError:  # the API process is gone; the reader sees the EOF and stops us
            self.gone = True


class Intake:
    """The API's messages, on the main thread: requests in, cancellations, status queries."""

    def __init__(self, channel: ipc.BlockingChannel, sched: Scheduler, outbox: Outbox,
                 live: dict[int, GenRequest], figures: Any) -> None:
        self._channel, self._sched, self._outbox, self._live = channel, sched, outbox, live
        self._figures = figures
        self._constrainer: Any = None

    def run(self, messages: Any) -> None:
        """Until the API process closes its end (``messages`` is its channel's iterator)."""
        for msg in messages:
            tag = msg[0]
            if tag == ipc.GEN:
                self._gen(msg)
            elif tag == ipc.CANCEL:
                req = self._live.pop(msg[1], None)
                if req is not None:
                    self._sched.cancel(req)
            elif tag == ipc.STATUS:
                self._send([ipc.FIGURES, msg[1], self._figures()])

    def _send(self, msg: list) -> None:
        with contextlib.suppress(OSError):  # the API is gone: the loop ends at its EOF
            self._channel.send(msg)

    def _gen(self, msg: list) -> None:
        req = ipc.gen_request(msg, self._outbox.sink(msg[1]))
        if req.spec is not None:
            refused = self._constrain(req)
            if refused is not None:
                self._send([ipc.EVENTS, [ipc.event_item(req.id, refused)]])
                return
        self._live[req.id] = req
        self._sched.submit(req)

    def _constrain(self, req: GenRequest) -> Refused | None:
        """Build the request's matcher (the vocabulary's token trie made on first use); the
        refusal if it cannot be built."""
        from plimsoll import constrain

        try:
            if self._constrainer is None:
                self._constrainer = constrain.Constrainer(self._sched.engine.tokenizer)
            if req.spec.kind == "tool_call" and self._constrainer.markup is None:
                return None  # a format we cannot force: rendered, parsed, not enforced
            req.constraint = self._constrainer.constraint(req.spec)
        except constrain.SpecError as e:
            return Refused(400, f"{e}; simplify the schema.", "invalid_schema")
        except Exception as e:  # the grammar library failed: this request, not the engine
            log.exception("building the constraint of request %s failed", req.id)
            return Refused(500, f"the constraint could not be built: {e}", "worker_error")
        return None


def loaded_figures(cfg: WorkerConfig, sched: Scheduler, applied: dict[str, Any]) -> dict:
    """What the API process reads once from the loaded engine (the status report's fixed
    figures, the tokenizer's EOS ids)."""
    eng = sched.engine
    return {"pid": os.getpid(), "native_max_context": eng.facts.native_max_context,
            "block_bytes": eng.block_bytes,
            "kv_bytes_per_token": eng.block_bytes // cfg.block_tokens,
            "kv_dtype": eng.facts.kv_format, "applied_limits": applied,
            "eos_token_ids": sorted(sched.eos_ids)}


def live_figures_of(sched: Scheduler, guard: Any) -> Any:
    """The answer to a status query: the scheduler's published snapshot, the trip, MLX's
    memory and this process's resident set, the guard's figures."""
    import psutil

    me = psutil.Process()

    def figures() -> dict[str, Any]:
        guard_status = guard.status() if guard else None
        eng, drafter = sched.engine, sched.drafter
        return {"stats": sched.stats, "tripped": sched.tripped,
                "memory": eng.memory(), "rss": me.memory_info().rss,
                "guard": guard_status,
                "cgroup": guard_status if isinstance(guard, SelfGuard) else None,
                "extra": {"kernels": eng.kernels.report(),
                          "one_forward": eng.mixers.report(),
                          **({} if drafter is None else {"speculative": drafter.report()})}}
    return figures


class _Terminated(BaseException):
    """SIGTERM: leave the read loop and stop as at the end of input."""


def serve(fd: int, api_pid: int) -> int:
    """The engine process's life (see the module docstring); returns its exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = ipc.BlockingChannel(socket.socket(fileno=fd))
    messages = channel.messages()
    first = next(messages, None)
    if first is None or first[0] != ipc.CONFIG:
        return 2  # the API process went before it said anything
    _, config_json, want_tokenizer = first
    cfg = WorkerConfig.model_validate_json(config_json)
    basic_logging()
    guard = SelfGuard.find(also=(api_pid,))  # the cgroup (shared with the API), or the line
    live: dict[int, GenRequest] = {}
    outbox = Outbox(channel, live)
    sched, loaded = start_scheduler(cfg, guard, flush=outbox.flush, also_rss=(api_pid,))
    if sched.setup_error is not None:
        err = sched.setup_error
        with contextlib.suppress(OSError):
            channel.send([ipc.FAILED, type(err).__name__, str(err)])
        if not isinstance(err, SystemExit):
            log.error("the engine did not load", exc_info=err)
        return 1
    pickled, why = tokenizer.to_api(sched.engine.tokenizer) if want_tokenizer else (None, "")
    if why:
        log.warning("the tokenizer could not be pickled (%s): the API process loads it", why)
    def on_sigterm(*_: Any) -> None:
        channel.stop_reading()  # the loop ends at its next read even if the raise below is
        raise _Terminated  # swallowed (Python ignores it inside a weakref callback, say)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        channel.send([ipc.READY, loaded_figures(cfg, sched, loaded["applied"]), pickled])
        Intake(channel, sched, outbox, live, live_figures_of(sched, guard)).run(messages)
    except (_Terminated, OSError):
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop below is not interrupted
        sched.stop(10.0 if sched.disk is None else 120.0)
        if sched.disk is not None:
            sched.disk.close()
        channel.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m plimsoll.worker.engine_proc FD API_PID "
                         "(started by the worker's API process)")
    status = serve(int(args[0]), int(args[1]))
    # Everything that must outlive the process is done (limits restored, the disk tier
    # closed, the socket shut); interpreter finalization would only tear MLX down, and
    # measured here it aborts (SIGABRT in a C++ destructor) in about half the exits after
    # an engine that ran on a thread just ended: end as multiprocessing's children do.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
