"""The soak's load: a seeded plan of what clients send, and the clients that send it.

The mlx#3186 protocol adapted to one host: 2–8 clients at once (the level changes every
``phase_s``), each either in a **growing agentic session** (every turn resends the whole
conversation, one reply and one tool output longer; all sessions share a long system prompt,
then diverge; a finished session's blocks are left to be evicted) or sending a **one-off
prompt** no one shares (cache churn); some answers are **cancelled mid-stream** (the client
closes the connection after a few chunks), some requests name the **other model** (a swap),
and every ``idle_every_s`` all clients pause longer than the server's idle TTL (an **idle
unload**). The text is words of Python source, so any server's tokenizer counts it about
one token a word.

:func:`run_clients` drives an OpenAI-compatible ``/v1/chat/completions`` (plimsoll serve or
mlx_lm.server alike) and returns one :class:`Record` per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field

import httpx

_VOCABULARY = ("def return self import from class for while with yield lambda value result "
         "items index count total error raise except finally assert list dict tuple set "
         "print format string bytes encode decode open read write close path name args "
         "kwargs config cache block token model prompt memory limit pool admit refuse "
         "queue stream chunk reply session tool output request worker proxy server "
         "socket bind listen accept thread lock event future task loop sleep timeout "
         "retry status code header body json parse load dump split join strip lower "
         "upper replace start end step range len sum min max sorted reversed zip enumerate "
         "filter map any all isinstance getattr setattr hasattr super property static "
         "method module package test assert fixture param mark skip fail pass break "
         "continue global nonlocal await async none true false")
WORDS = tuple(_VOCABULARY.split())


@dataclass(frozen=True)
class Shape:
    """What the clients do, and for how long (words stand in for tokens)."""

    duration_s: float = 30.0
    levels: tuple[int, ...] = (2, 4, 8, 6, 3, 8, 5, 2)  # clients at once, one per phase
    phase_s: float = 10.0
    idle_every_s: float = 0.0  # 0: never pause
    idle_gap_s: float = 0.0
    shared_words: int = 300  # the system prompt every session shares
    turn_words: tuple[int, int] = (60, 240)  # a tool output appended per turn
    session_turns: tuple[int, int] = (3, 10)
    churn_words: tuple[int, int] = (100, 600)
    max_tokens: int = 16
    p_churn: float = 0.25
    p_cancel: float = 0.15
    p_other_model: float = 0.1
    seed: int = 0

    def level_at(self, t: float) -> int:
        """Clients active ``t`` seconds in (0 during an idle gap)."""
        if self.idle_every_s and self.idle_gap_s and t % self.idle_every_s >= (
                self.idle_every_s - self.idle_gap_s):
            return 0
        return self.levels[int(t // self.phase_s) % len(self.levels)]


@dataclass
class Record:
    """One request as its client saw it."""

    t0: float
    kind: str  # "turn" | "churn"
    model: str
    words: int
    stream: bool
    cancel_after: int | None  # chunks read before closing (None: read to the end)
    status: int | str = 0  # HTTP status, or "transport:<error>"
    code: str | None = None  # the refusal's code (body or mid-stream error event)
    chunks: int = 0
    cancelled: bool = False
    ttft_s: float | None = None
    t1: float = 0.0


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def shared_prompt(n: int) -> str:
    """The system prompt every session starts with: the same words every run."""
    return "You are a coding agent. Rules: " + text(random.Random(12345), n)


@dataclass
class Session:
    """One agentic conversation; grows a turn at a time until ``turns`` is reached."""

    messages: list[dict]
    turns: int
    done: int = 0

    @property
    def words(self) -> int:
        return sum(len(str(m["content"]).split()) for m in self.messages)


def new_session(rng: random.Random, shape: Shape, system: str) -> Session:
    task = f"Task {rng.randrange(10**9)}: fix " + text(rng, rng.randint(20, 80))
    return Session([{"role": "system", "content": system}, {"role": "user", "content": task}],
                   rng.randint(*shape.session_turns))


def error_code(raw: bytes | str) -> str | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return err.get("code") or err.get("type")
    return str(err) if err else None


async def send(client: httpx.AsyncClient, url: str, rec: Record, body: dict) -> str:
    """Send one request, fill ``rec``; the reply's text ("" when none)."""
    reply: list[str] = []
    try:
        if not rec.stream:
            r = await client.post(url, json=body)
            rec.status = r.status_code
            if r.status_code == 200:
                msg = r.json()["choices"][0]["message"]
                reply.append(msg.get("content") or "")
                rec.chunks = 1
            else:
                rec.code = error_code(r.content)
            return "".join(reply)
        async with client.stream("POST", url, json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.code = error_code(await r.aread())
                return ""
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec.code = error_code(line[6:]) or "stream_error"
                    break
                delta = (data.get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content"):
                    rec.ttft_s = rec.ttft_s or time.monotonic() - rec.t0
                    reply.append(delta["content"])
                    rec.chunks += 1
                if rec.cancel_after is not None and rec.chunks >= rec.cancel_after:
                    rec.cancelled = True  # leaving the block closes the connection
                    break
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as err:
        rec.status = f"transport:{type(err).__name__}"
    finally:
        rec.t1 = time.monotonic()
    return "".join(reply)


@dataclass
class Clients:
    """The running load: its records, and the stop flag the run sets."""

    records: list[Record] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0


async def client_loop(idx: int, shape: Shape, url: str, models: tuple[str, str],
                      load: Clients, start: float) -> None:
    rng = random.Random(shape.seed * 1009 + idx)
    system = shared_prompt(shape.shared_words)
    session = new_session(rng, shape, system)
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        while not load.stop.is_set():
            if idx >= shape.level_at(time.monotonic() - start):
                await asyncio.sleep(0.2)
                continue
            model = models[1] if rng.random() < shape.p_other_model else models[0]
            stream = rng.random() < 0.6
            cancel = rng.randint(1, 6) if stream and rng.random() < shape.p_cancel else None
            if rng.random() < shape.p_churn:
                kind = "churn"
                messages = [{"role": "user", "content": f"Unique {rng.randrange(10**12)}: "
                             + text(rng, rng.randint(*shape.churn_words))}]
            else:
                kind = "turn"
                messages = list(session.messages)
            rec = Record(time.monotonic(), kind, model,
                         sum(len(str(m["content"]).split()) for m in messages), stream, cancel)
            load.records.append(rec)
            load.in_flight += 1
            try:
                reply = await send(client, url + "/v1/chat/completions", rec, {
                    "model": model, "messages": messages, "max_tokens": shape.max_tokens,
                    "temperature": 0.7, "stream": stream})
            finally:
                load.in_flight -= 1
            if kind == "turn" and rec.status == 200:
                session.messages += [
                    {"role": "assistant", "content": reply or "(no text)"},
                    {"role": "user", "content": "Tool output:\n"
                     + text(rng, rng.randint(*shape.turn_words))}]
                session.done += 1
                if session.done >= session.turns:
                    session = new_session(rng, shape, system)
            elif kind == "turn" and rec.status not in (429, 503):
                session = new_session(rng, shape, system)  # refused for good: start over
            if rec.status in (429, 503) or isinstance(rec.status, str):
                await asyncio.sleep(0.5)  # a refusal says retry later


async def run_clients(shape: Shape, url: str, models: tuple[str, str],
                      load: Clients | None = None) -> Clients:
    """Every client for ``shape.duration_s`` (or until ``load.stop`` is set); then they
    stop starting requests, and those in flight finish (bounded by their timeout)."""
    load = load or Clients()
    start = time.monotonic()
    tasks = [asyncio.create_task(client_loop(i, shape, url, models, load, start))
             for i in range(max(shape.levels))]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(load.stop.wait(), shape.duration_s)
    load.stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return load
