"""The requests the benchmarks send, and the streaming client that times every token.

Text is Python standard-library source (fixed files, fixed order) cut into chunks of about
``target`` tokens with the model's own ``tokenizer.json``, taken in order, so the same
invocation sends the same bytes to every server and no two prompts share text unless a phase
means them to (the sub-agents' shared system prompt).

The client speaks OpenAI chat completions (or completions) over SSE: :func:`timed_stream`
(threads) and :func:`async_stream` (one asyncio loop for many streams, so the client's own
cost stays small) both record every token chunk's arrival time and read ``usage`` from the
final chunk (``stream_options.include_usage``). Every request has a deadline; errors are
returned as values so a server that dies mid-session ends that session, not the run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

CHAT = "/v1/chat/completions"
STDLIB_FILES = ["argparse.py", "textwrap.py", "shlex.py", "json/decoder.py", "json/encoder.py",
                "functools.py", "dataclasses.py", "pathlib.py", "subprocess.py", "tempfile.py",
                "typing.py", "inspect.py", "collections/__init__.py", "logging/__init__.py",
                "unittest/case.py", "configparser.py", "enum.py", "threading.py", "tarfile.py",
                "ast.py", "doctest.py", "pydoc.py", "difflib.py", "pickle.py", "statistics.py"]
STREAM_PROMPT_TOKENS = [96, 160, 224, 288, 352, 416, 480, 544]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "judge", "boxing", "matches", "near", "the", "old", "river",
         "bank", "and", "count", "their", "golden", "coins"]


class SourceText:
    """Standard-library source as chunks of whole lines of about ``target`` tokens each."""

    def __init__(self, tokenizer_json: Path, files: list[str] = STDLIB_FILES) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_json))
        root = Path(sysconfig.get_paths()["stdlib"])
        self._lines: list[tuple[str, int, str]] = []
        for name in files:
            if not (root / name).is_file():
                continue  # a long list may name a file one Python version lacks
            for n, line in enumerate((root / name).read_text().splitlines(keepends=True), 1):
                self._lines.append((name, n, line))
        counts = self._tok.encode_batch([line for _, _, line in self._lines])
        self._counts = [len(c.ids) for c in counts]
        self._pos = 0
        self.digest = hashlib.sha256("".join(x[2] for x in self._lines).encode()).hexdigest()

    def count(self, text: str) -> int:
        return len(self._tok.encode(text).ids)

    def take(self, target: int) -> str:
        return self.take_file(target)[1]

    def take_file(self, target: int) -> tuple[dict, str]:
        """The next whole lines worth at least ``target`` tokens, and the read_file arguments
        that would have returned them."""
        start, tokens = self._pos, 0
        while True:
            while tokens < target:  # per-line counts: a cheap over-estimate of the whole
                if self._pos == len(self._lines):
                    raise ValueError("ran out of standard-library text; ask for fewer tokens")
                tokens += self._counts[self._pos]
                self._pos += 1
            chunk = self._lines[start:self._pos]
            text = "".join(line for _, _, line in chunk)
            tokens = self.count(text)  # the exact count decides
            if tokens >= target:
                args = {"path": f"Lib/{chunk[0][0]}", "lines": f"{chunk[0][1]}-{chunk[-1][1]}"}
                return args, text


def word_prompt(i: int, words: int) -> str:
    """A short prompt of ``words`` words, different for each ``i`` (no shared prefix to hit)."""
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words)) + f" ({i})"


def user_body(model: str | None, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0}
    return body if model is None else {"model": model, **body}


def _token_in(choice: dict) -> tuple[bool, str]:
    """Whether a streamed choice carries a token, and its text: a chat delta's content,
    reasoning or tool call, or a completion's text."""
    delta = choice.get("delta") or {}
    text = delta.get("content") or choice.get("text") or ""
    return bool(text or any(delta.get(k) for k in ("reasoning", "reasoning_content",
                                                    "tool_calls"))), text


class _Record:
    """What one stream gathers while its lines arrive."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: list[float] = []
        self.pieces: list[str] = []
        self.usage: dict = {}
        self.finish = self.error = None
        self.closed = False

    def line(self, line: str) -> bool:
        """Take one SSE line; False once the stream is done (``[DONE]``)."""
        if not line.startswith("data:"):
            return True  # SSE comments (mlx_lm's ": keepalive n/m") and blank lines
        data = line[5:].strip()
        if data == "[DONE]":
            return False
        chunk = json.loads(data)
        if isinstance(chunk.get("error"), dict | str):
            self.error = f"stream error: {chunk['error']}"
            return False
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or ():
            token, text = _token_in(choice)
            if token:
                self.times.append(time.perf_counter())
                self.pieces.append(text)
            self.finish = choice.get("finish_reason") or self.finish
        return True

    def result(self, status_code: int | None = None) -> dict:
        t = self.times
        return {"t_start": self.t0, "t_first": t[0] if t else None,
                "t_last": t[-1] if t else None, "t_end": time.perf_counter(), "times": t,
                "ttft_s": t[0] - self.t0 if t else None,
                "total_s": time.perf_counter() - self.t0, "text": "".join(self.pieces),
                "token_chunks": len(t), "finish_reason": self.finish, "error": self.error,
                "status_code": status_code, "closed_by_client": self.closed,
                "prompt_tokens": self.usage.get("prompt_tokens"),
                "completion_tokens": self.usage.get("completion_tokens"),
                "cached_tokens": (self.usage.get("prompt_tokens_details") or {})
                .get("cached_tokens")}


def _streamed(body: dict) -> dict:
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def timed_stream(base_url: str, body: dict, timeout_s: float, *,
                 client: httpx.Client | None = None, path: str = CHAT,
                 stop: threading.Event | None = None, started: threading.Event | None = None,
                 started_after: int = 1) -> dict:
    """One streamed request, on ``client`` (a kept-alive connection) or its own: every token
    chunk's arrival time, the text, usage, or an error string. ``stop`` set: the client closes
    the stream (the server should cancel). ``started`` is set once ``started_after`` chunks
    have arrived."""
    own = client is None
    client = client or httpx.Client()  # (tens of ms of one core: not the server's time)
    rec = _Record()
    try:
        with client.stream("POST", base_url + path, json=_streamed(body),
                           timeout=httpx.Timeout(timeout_s, connect=10.0)) as response:
            if response.status_code != 200:
                rec.error = (f"HTTP {response.status_code}: "
                             f"{response.read().decode(errors='replace')[:500]}")
                return rec.result(response.status_code)
            for line in response.iter_lines():
                if time.perf_counter() - rec.t0 > timeout_s:
                    rec.error = f"request exceeded its {timeout_s:.0f} s deadline"
                    break
                if stop is not None and stop.is_set():
                    rec.closed = True
                    break
                if not rec.line(line):
                    break
                if started is not None and len(rec.times) >= started_after:
                    started.set()
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        rec.error = f"{type(err).__name__}: {err}"
    finally:
        if own:
            client.close()
    return rec.result(200)


async def async_stream(client: httpx.AsyncClient, url: str, body: dict, go: asyncio.Event,
                       timeout_s: float) -> dict:
    """:func:`timed_stream` on an asyncio client, sent once ``go`` is set."""
    await go.wait()
    rec = _Record()
    try:
        async with client.stream("POST", url, json=_streamed(body), timeout=timeout_s) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return rec.result(r.status_code)
            async for line in r.aiter_lines():
                if not rec.line(line):
                    break
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        rec.error = f"{type(err).__name__}: {err}"
    return rec.result(200)


def decode_tps(result: dict) -> float | None:
    """Tokens/s after the first token: (completion − 1) / (last token − first token)."""
    n = result.get("completion_tokens") or result.get("token_chunks") or 0
    first, last = result.get("t_first"), result.get("t_last")
    if n < 2 or first is None or last is None or last <= first:
        return None
    return (n - 1) / (last - first)


def steady_step_ms(times: list[list[float]]) -> float | None:
    """The median stream's time between tokens while every stream decodes (from the last
    stream's first token to the first stream's last): the server's decode step with no
    prompt being prefilled beside it (None: the streams never all decoded at once, or a
    stream had fewer than two tokens in that window)."""
    if not times or any(not t for t in times):
        return None
    lo, hi = max(t[0] for t in times), min(t[-1] for t in times)
    steps = []
    for t in times:
        inside = [x for x in t if lo <= x <= hi]
        if len(inside) < 2:
            return None
        steps.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return 1000 * statistics.median(steps)


def stream_figures(results: list[dict]) -> dict:
    """Streams released together: aggregate tok/s (all completion tokens ÷ first send to last
    end, prefill included), tok/s after the first tokens, the median stream's time between
    tokens (the server's step as a client sees it), TTFTs and completion tokens."""
    ok = [r for r in results if not r.get("error") and r.get("t_first") is not None]
    out: dict = {"streams": len(results), "completed": len(ok),
                 "errors": [r["error"] for r in results if r.get("error")][:3]}
    if not ok:
        return out
    tokens = [r.get("completion_tokens") or r["token_chunks"] for r in ok]
    wall = max(r["t_end"] for r in ok) - min(r["t_start"] for r in ok)
    span = max(r["t_last"] for r in ok) - min(r["t_first"] for r in ok)
    steps = sorted((r["t_last"] - r["t_first"]) / (n - 1)
                   for r, n in zip(ok, tokens, strict=True) if n > 1)
    ttfts = [r["ttft_s"] for r in ok]
    return out | {
        "completion_tokens": sum(tokens), "wall_s": wall, "aggregate_tps": sum(tokens) / wall,
        "aggregate_tps_after_first_token": (sum(tokens) - len(ok)) / span if span > 0 else None,
        "step_ms": 1000 * statistics.median(steps) if steps else None,
        "steady_step_ms": steady_step_ms([r.get("times") or [] for r in ok]),
        "ttft_s": ttfts, "ttft_max_s": max(ttfts), "tokens_each_min": min(tokens),
        "per_stream_decode_tps": [decode_tps(r) for r in ok],
        "completion_tokens_each": [r.get("completion_tokens") for r in ok],
        "finish_reasons": [r.get("finish_reason") for r in ok]}


def concurrent_streams(base_url: str, bodies: list[dict], timeout_s: float,
                       path: str = CHAT) -> dict:
    """All requests at once, one thread and connection each, released together."""
    barrier = threading.Barrier(len(bodies))

    def one(body: dict) -> dict:
        with httpx.Client() as client:
            barrier.wait(timeout=30)
            return timed_stream(base_url, body, timeout_s, client=client, path=path)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return stream_figures(list(pool.map(one, bodies)))


async def async_concurrent(base_url: str, bodies: list[dict], timeout_s: float) -> dict:
    """All requests at once from one asyncio loop, one connection each, released together."""
    go = asyncio.Event()
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        tasks = [asyncio.create_task(async_stream(client, base_url + CHAT, body, go, timeout_s))
                 for body in bodies]
        await asyncio.sleep(0.05)
        go.set()
        return stream_figures(list(await asyncio.gather(*tasks)))


def single_decode(client: httpx.Client, base_url: str, model: str | None, prompt: str,
                  new_tokens: int, ignore_eos: bool, timeout_s: float) -> dict:
    """One request for ``new_tokens``; ``ignore_eos`` sent if asked and retried without it
    if the server refuses it (400/422)."""
    body = user_body(model, prompt, new_tokens)
    result = timed_stream(base_url, {**body, "ignore_eos": True} if ignore_eos else body,
                          timeout_s, client=client)
    result["ignore_eos_sent"] = ignore_eos
    if ignore_eos and result.get("status_code") in (400, 422):
        refused = result["error"]
        result = timed_stream(base_url, body, timeout_s, client=client)
        result.update(ignore_eos_sent=False, ignore_eos_refused=refused)
    result["decode_tps"] = decode_tps(result)
    # End to end, TTFT included: a cross-check for a server that delivers tokens in bursts
    # (a late first chunk shortens last − first and flatters decode_tps).
    result["e2e_tps"] = ((result.get("completion_tokens") or 0) / result["total_s"]
                         if result.get("total_s") else None)
    result["stopped_early"] = (result.get("completion_tokens") or 0) < new_tokens
    return result


def accepts_ignore_eos(base_url: str, model: str | None, timeout_s: float) -> bool:
    """Whether the server takes ``ignore_eos`` (vLLM's extension): a 2-token probe."""
    body = {**user_body(model, "Say hello.", 2), "ignore_eos": True}
    return timed_stream(base_url, body, timeout_s).get("status_code") not in (400, 422)
