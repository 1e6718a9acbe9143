"""The API process's side of the engine process: start it, talk to it, notice its end.

:func:`process_backend` is the worker's default backend (:func:`plimsoll.worker.app.make_app`):
it starts the engine process (:mod:`.engine_proc`) and yields what the routes read from
``app.state``, the :class:`EngineClient` in the scheduler's place. The routes call it as
they would a scheduler — ``submit``, ``cancel`` — and its events reach each
request's queue on the event loop as one ``EVENTS`` message a scheduler pass arrives
(:mod:`.ipc`): no thread, no mailbox, no per-token wake-up. This process holds no KV and
imports no mlx; the tokenizer is the engine's own, handed over at start
(:mod:`.tokenizer`).

A crashed engine process (its socket's EOF) is noticed at once: it is reaped (killed if it
hangs on), every open request gets a ``Refused`` 503 ``engine_lost`` with its exit status
— a stream's protocol error event (the same builders a drain that ran out uses), a 503
otherwise — and the next request starts a new engine process through the same load path,
after the old one is gone and its memory back (one start at a time; requests arriving
meanwhile wait for it). An engine ended by the footprint guard
(:data:`~plimsoll.guard.process.EXIT_FOOTPRINT`) ends this process with that status, as
a worker the guard ends: the proxy sees the exit it knows. A
crashed API process takes the engine with it: the engine reads the EOF and exits
(:mod:`.engine_proc`), and the proxy restarts the worker as it does for any crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

from plimsoll.core.worker_config import WorkerConfig
from plimsoll.guard.process import EXIT_FOOTPRINT

from . import ipc, prompt_pieces, tokenizer
from .events import GenRequest, Refused, Token

log = logging.getLogger("plimsoll.worker")

#: How long a status query waits for the engine's answer.
STATUS_TIMEOUT_S = 10.0
#: How long an engine whose socket closed may take to exit before it is killed.
EXIT_WAIT_S = 5.0


class EngineFailed(Exception):
    """The engine process reported that loading failed (its exception's type and text)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "did not exit"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
        return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class EngineClient:
    """The engine process as the routes see it: the scheduler's interface, over the wire."""

    #: Sinks are called on the event loop (the reader runs there): a request's sink is its
    #: queue's ``put_nowait``, with no mailbox between (see :func:`.submit.submit`).
    sinks_on_loop = True

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen | None = None
        self.facts: dict[str, Any] = {}
        self.tokenizer: Any = None
        self.down: str | None = "not started"  # why no engine serves now; None while one does
        self.starts = 0
        self._channel: ipc.LoopChannel | None = None
        self._open: dict[int, GenRequest] = {}  # requests the engine answers, by id
        self._queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._ready: asyncio.Future | None = None
        self._starting: asyncio.Task | None = None
        self._lost_tasks: set[asyncio.Task] = set()
        self._last_live: dict[str, Any] = {}
        self._closing = False

    # --- what the routes call -------------------------------------------------------------
    def submit(self, gen: GenRequest) -> None:
        """Hand ``gen`` to the engine; its events come to ``gen.sink`` (on the loop)."""
        self._open[gen.id] = gen
        if self._channel is not None:
            self._channel.send(ipc.gen_message(gen))
        # no channel: the engine just went, and its loss answers every open request

    def cancel(self, gen: GenRequest) -> None:
        """End ``gen``: the caller reads no more of its events."""
        gen.cancelled.set()
        if self._open.pop(gen.id, None) is not None and self._channel is not None:
            self._channel.send([ipc.CANCEL, gen.id])

    async def ensure_running(self) -> Refused | None:
        """Start the engine process if none runs, or wait for the start under way; None
        once one serves, else the 503 for the request that asked."""
        while self.down is not None:
            if self._closing:
                return Refused(503, "the worker is shutting down", "worker_stopping", 1)
            if self._starting is None:
                self._starting = asyncio.ensure_future(self.start())
            starting = self._starting
            try:
                await asyncio.shield(starting)
            except Exception as err:
                return Refused(503, f"the worker's engine process could not be started: "
                               f"{err}", "engine_lost", 1)
            finally:
                if self._starting is starting and starting.done():
                    self._starting = None
        return None

    async def live(self) -> dict[str, Any]:
        """The engine's live figures (:func:`plimsoll.worker.app.live_figures`), this
        process's resident set added; the last ones, with ``down``, while none runs."""
        import psutil

        figures = dict(self._last_live)
        if self.down is None and self._channel is not None:
            loop = asyncio.get_running_loop()
            qid = next(self._query_ids)
            fut = self._queries[qid] = loop.create_future()
            self._channel.send([ipc.STATUS, qid])
            try:
                figures = self._last_live = await asyncio.wait_for(fut, STATUS_TIMEOUT_S)
            except (TimeoutError, ConnectionError):
                self._queries.pop(qid, None)
        if figures:
            figures = {**figures, "rss": figures["rss"] + psutil.Process().memory_info().rss}
        return {**figures, "engine_pid": self.proc.pid if self.proc else None,
                "down": self.down}

    # --- the engine process's life --------------------------------------------------------
    async def start(self) -> None:
        """One engine process, loaded and ready (no overlap: the previous one has exited)."""
        loop = asyncio.get_running_loop()
        if self.proc is not None and self.proc.poll() is None:
            await asyncio.to_thread(_wait_or_kill, self.proc, EXIT_WAIT_S)
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "plimsoll.worker.engine_proc", str(theirs.fileno()),
                 str(os.getpid())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.proc, self.starts = proc, self.starts + 1
        self._ready = ready = loop.create_future()
        _, channel = await loop.connect_accepted_socket(
            lambda: ipc.LoopChannel(self._on_message, functools.partial(self._on_lost, proc)),
            ours)
        self._channel = channel
        channel.send([ipc.CONFIG, self.cfg.model_dump_json(), self.tokenizer is None])
        warm = None
        if self.tokenizer is None:  # the tokenizer's imports, while the engine loads
            warm = asyncio.ensure_future(asyncio.to_thread(tokenizer.tokenizer_modules))
        try:
            facts, pickled = await ready
        finally:
            if warm is not None:
                with contextlib.suppress(Exception):
                    await warm
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(
                lambda: prompt_pieces.PromptTokenizer(tokenizer.from_engine(
                    pickled, self.cfg.model_dir, facts["eos_token_ids"])))
            if refused := self.tokenizer.pieces_refused:
                log.info("prompts are tokenized whole: %s", refused)
        self.facts = facts
        self.down = None
        log.info("engine process %d ready%s", proc.pid,
                 f" (start {self.starts})" if self.starts > 1 else "")

    def _on_message(self, msg: list) -> None:
        tag = msg[0]
        if tag == ipc.EVENTS:
            open_ = self._open
            for item in msg[1]:
                gen = open_.get(item[1])
                if gen is None:  # cancelled here, or answered already
                    continue
                if item[0] == ipc.EV_TOKEN:  # the hot path: one per running row a step
                    gen.sink(Token(item[2]))
                    continue
                if item[0] in ipc.TERMINAL:
                    del open_[item[1]]
                gen.sink(ipc.event_of(item))
        elif tag == ipc.FIGURES:
            fut = self._queries.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif tag == ipc.READY and self._ready is not None and not self._ready.done():
            self._ready.set_result((msg[1], msg[2]))
        elif tag == ipc.FAILED and self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineFailed(msg[1], msg[2]))

    def _on_lost(self, proc: subprocess.Popen, exc: Exception | None) -> None:
        if self.proc is proc:
            self._channel = None
        task = asyncio.ensure_future(self._lost(proc))
        self._lost_tasks.add(task)
        task.add_done_callback(self._lost_tasks.discard)

    async def _lost(self, proc: subprocess.Popen) -> None:
        """The engine's end closed: reap it, then answer everything that waited on it."""
        rc = await asyncio.to_thread(_wait_or_kill, proc, EXIT_WAIT_S)
        if self._closing or self.proc is not proc:
            return
        why = f"the worker's engine process (pid {proc.pid}) {describe_exit(rc)}"
        if rc == EXIT_FOOTPRINT:
            log.critical("%s: its footprint crossed the guard's hard line; ending the worker",
                         why)
            logging.shutdown()
            os._exit(EXIT_FOOTPRINT)
        serving, self.down = self.down is None, why
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(why))
        if not serving:  # it ended while loading: its start answers for it
            return
        log.error("%s; %d open request(s) end with an error, the next request starts it again",
                  why, len(self._open))
        gone, self._open = list(self._open.values()), {}
        refused = Refused(503, f"{why} while this request ran; retry: the next request starts "
                          "it again", "engine_lost", 1)
        for gen in gone:
            gen.sink(refused)
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(ConnectionError(why))
        self._queries.clear()

    async def close(self, timeout_s: float) -> None:
        """Close the engine's input (it stops, spilling the disk tier if there is one) and
        wait for its exit, killing it after ``timeout_s``."""
        self._closing = True
        if self._starting is not None:
            with contextlib.suppress(Exception):
                await self._starting
        if self._channel is not None and self._channel.transport is not None:
            self._channel.transport.close()
        if self.proc is not None:
            rc = await asyncio.to_thread(_wait_or_kill, self.proc, timeout_s)
            log.info("engine process %d %s", self.proc.pid, describe_exit(rc))


@contextlib.asynccontextmanager
async def process_backend(cfg: WorkerConfig) -> AsyncIterator[dict[str, Any]]:
    """The engine in a process of its own: started and loaded, stopped at exit."""
    client = EngineClient(cfg)
    try:
        try:
            await client.start()
        except EngineFailed as err:
            if err.kind == "SystemExit":
                raise SystemExit(str(err)) from None
            raise RuntimeError(f"the engine did not load: {err.kind}: {err}") from None
        f = client.facts
        yield {"scheduler": client, "engine": client, "tokenizer": client.tokenizer,
               "native_max_context": f["native_max_context"], "block_bytes": f["block_bytes"],
               "kv_bytes_per_token": f["kv_bytes_per_token"], "kv_dtype": f["kv_dtype"],
               "applied_limits": f["applied_limits"], "live": client.live,
               "constrained_decoding": True,
               "status_extra": lambda: {"prompt_pieces": client.tokenizer.figures()}}
    finally:  # the disk tier's shutdown spill runs in the engine process: give it time
        await client.close(15.0 if cfg.disk_cache_dir is None else 130.0)
