"""The workload of bench/agentic.py: deterministic text, a streaming client, the three phases.

Text is Python standard-library source (fixed files, fixed order) cut into chunks of about
``target`` tokens with the model's own ``tokenizer.json``, so the same invocation sends the
same bytes to every server. The client speaks OpenAI chat completions over SSE; it times the
first streamed token (TTFT) and the last one, and reads ``usage`` from the final chunk
(``stream_options.include_usage``). Every request has a deadline; errors are returned as
values so a server that dies mid-session ends that session, not the run.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

STDLIB_FILES = ["argparse.py", "textwrap.py", "shlex.py", "json/decoder.py", "json/encoder.py",
                "functools.py", "dataclasses.py", "pathlib.py", "subprocess.py", "tempfile.py"]
SYSTEM = ("You are a coding agent working in a Python repository. You read files with the "
          "`read_file` tool and answer in one short sentence.")
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a range of lines of a file in the repository.",
    "parameters": {"type": "object", "required": ["path"], "properties": {
        "path": {"type": "string"},
        "lines": {"type": "string", "description": "first-last, 1-based, inclusive"}}}}}]
TASK = ("Review the command-line parsing code in this repository: read the relevant files "
        "section by section and tell me which functions handle option prefixes.")


class SourceText:
    """Standard-library source as (label, text) chunks of about ``target`` tokens each."""

    def __init__(self, tokenizer_json: Path, files: list[str] | None = None) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_json))
        root = Path(sysconfig.get_paths()["stdlib"])
        self._lines: list[tuple[str, int, str]] = []
        for name in files or STDLIB_FILES:
            if files and not (root / name).is_file():
                continue  # a longer list may name files one Python version lacks
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
                    raise ValueError("ran out of standard-library text; lower the turn count")
                tokens += self._counts[self._pos]
                self._pos += 1
            chunk = self._lines[start:self._pos]
            text = "".join(line for _, _, line in chunk)
            tokens = self.count(text)  # the exact count decides
            if tokens >= target:
                args = {"path": f"Lib/{chunk[0][0]}", "lines": f"{chunk[0][1]}-{chunk[-1][1]}"}
                return args, text


def stream_chat(client: httpx.Client, base_url: str, body: dict, timeout_s: float) -> dict:
    """One streamed chat completion: TTFT, total time, text, usage, or an error string."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    pieces: list[str] = []
    usage, finish, token_chunks = None, None, 0
    try:
        with client.stream("POST", base_url + "/v1/chat/completions", json=body,
                           timeout=httpx.Timeout(timeout_s, connect=10.0)) as response:
            if response.status_code != 200:
                detail = response.read().decode(errors="replace")[:500]
                return {"error": f"HTTP {response.status_code}: {detail}",
                        "status_code": response.status_code}
            for line in response.iter_lines():
                if time.perf_counter() - t0 > timeout_s:
                    return {"error": f"request exceeded its {timeout_s:.0f} s deadline"}
                if not line.startswith("data:"):
                    continue  # SSE comments (mlx_lm's ": keepalive n/m") and blank lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or ""
                    if text or any(delta.get(k) for k in
                                   ("reasoning", "reasoning_content", "tool_calls")):
                        last = time.perf_counter()
                        first = first or last
                        token_chunks += 1
                        pieces.append(text)
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    end = time.perf_counter()
    usage = usage or {}
    return {
        "t_start": t0, "t_first": first, "t_last": last, "t_end": end,
        "ttft_s": None if first is None else first - t0,
        "total_s": end - t0,
        "text": "".join(pieces),
        "token_chunks": token_chunks,
        "finish_reason": finish,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    }


def decode_tps(result: dict) -> float | None:
    """Tokens/s after the first token: (completion − 1) / (last token − first token)."""
    n = result.get("completion_tokens") or result.get("token_chunks") or 0
    first, last = result.get("t_first"), result.get("t_last")
    if n < 2 or first is None or last is None or last <= first:
        return None
    return (n - 1) / (last - first)


def agentic_session(client: httpx.Client, base_url: str, model: str | None,
                    tool_outputs: list[tuple[dict, str]], max_tokens: int, timeout_s: float,
                    around_turn: Callable[[int, Callable[[], dict]], dict],
                    count_prompt: Callable[[dict], int]) -> list[dict]:
    """The growing conversation, one turn per tool output. Each turn resends everything so far
    plus one more exchange: an assistant message (the server's previous reply, with the
    ``read_file`` call that an agent would have made) and the tool's answer to that call.
    ``around_turn(n, send)`` wraps each request (the caller samples memory around it);
    ``count_prompt(body)`` counts prompt tokens for a server that reports no ``usage``."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": TASK}]
    records, reply = [], None
    for turn, (arguments, output) in enumerate(tool_outputs, 1):
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps(arguments)}}
        messages += [{"role": "assistant", "content": reply or None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": output}]
        body = _body(model, list(messages), max_tokens) | {"tools": TOOLS}
        record = around_turn(turn, lambda b=body: stream_chat(client, base_url, b, timeout_s))
        record["turn"] = turn
        if record.get("prompt_tokens") is None and not record.get("error"):
            record["prompt_tokens"] = count_prompt(body)  # the server sent no usage
            record["prompt_tokens_source"] = "local tokenizer"
        records.append(record)
        if record.get("error"):
            break
        reply = record["text"]
    return records


def local_prompt_counter(model_dir: Path) -> Callable[[dict], int]:
    """Prompt tokens of a request body, rendered with the model's own chat template."""

    def count(body: dict) -> int:
        from transformers import AutoTokenizer  # only when a server reports no usage

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        text = tok.apply_chat_template(body["messages"], tools=body.get("tools"),
                                       add_generation_prompt=True, tokenize=False)
        return len(tok.encode(text, add_special_tokens=False))

    return count


def _body(model: str | None, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    return body if model is None else {"model": model, **body}


def single_decode(client: httpx.Client, base_url: str, model: str | None, prompt: str,
                  new_tokens: int, ignore_eos: bool, timeout_s: float) -> dict:
    """One request for ``new_tokens``; retries without ``ignore_eos`` if the server refuses it."""
    body = _body(model, [{"role": "user", "content": prompt}], new_tokens)
    result = stream_chat(client, base_url, {**body, "ignore_eos": True} if ignore_eos else body,
                         timeout_s)
    result["ignore_eos_sent"] = ignore_eos
    if ignore_eos and result.get("status_code") in (400, 422):
        refused = result["error"]
        result = stream_chat(client, base_url, body, timeout_s)
        result.update(ignore_eos_sent=False, ignore_eos_refused=refused)
    result["decode_tps"] = decode_tps(result)
    # End to end, TTFT included: a cross-check for a server that delivers tokens in bursts
    # (a late first chunk shortens last − first and flatters decode_tps).
    result["e2e_tps"] = (result.get("completion_tokens") or 0) / result["total_s"] \
        if result.get("total_s") else None
    result["stopped_early"] = (result.get("completion_tokens") or 0) < new_tokens
    return result


def concurrent_streams(base_url: str, model: str | None, prompts: list[str], new_tokens: int,
                       timeout_s: float) -> dict:
    """All prompts at once, one thread and connection each, released together."""
    barrier = threading.Barrier(len(prompts))

    def one(prompt: str) -> dict:
        body = _body(model, [{"role": "user", "content": prompt}], new_tokens)
        with httpx.Client() as client:
            barrier.wait(timeout=30)
            return stream_chat(client, base_url, body, timeout_s)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    ok = [r for r in results if not r.get("error")]
    out: dict = {"streams": len(prompts), "completed": len(ok),
                 "errors": [r["error"] for r in results if r.get("error")]}
    if ok:
        tokens = sum(r.get("completion_tokens") or r["token_chunks"] for r in ok)
        wall = max(r["t_end"] for r in ok) - min(r["t_start"] for r in ok)
        firsts = [r["t_first"] for r in ok if r["t_first"] is not None]
        lasts = [r["t_last"] for r in ok if r["t_last"] is not None]
        out.update(
            completion_tokens=tokens, wall_s=wall, aggregate_tps=tokens / wall,
            aggregate_tps_after_first_token=(tokens - len(ok)) / (max(lasts) - min(firsts))
            if lasts and max(lasts) > min(firsts) else None,
            ttft_s=[r["ttft_s"] for r in ok],
            per_stream_decode_tps=[decode_tps(r) for r in ok],
            completion_tokens_each=[r.get("completion_tokens") for r in ok],
            finish_reasons=[r.get("finish_reason") for r in ok])
    return out
