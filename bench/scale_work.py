"""The requests of bench/scale.py, built once so both servers get the same bytes, and a client
that keeps every token's arrival time.

Text is standard-library source (:class:`harness_workload.SourceText`, a longer file list),
taken in order, so no two prompts share text unless a phase means them to (the sub-agents'
shared system prompt). Each phase that needs a cold prefix gets its own text.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
from harness_workload import TOOLS, SourceText

FILES = ["argparse.py", "textwrap.py", "shlex.py", "json/decoder.py", "json/encoder.py",
         "functools.py", "dataclasses.py", "pathlib.py", "subprocess.py", "tempfile.py",
         "typing.py", "inspect.py", "collections/__init__.py", "logging/__init__.py",
         "unittest/case.py", "configparser.py", "enum.py", "threading.py", "tarfile.py",
         "ast.py", "doctest.py", "pydoc.py", "difflib.py", "pickle.py", "statistics.py"]
STREAM_PROMPT_TOKENS = [96, 160, 224, 288, 352, 416, 480, 544]
SUB_SYSTEM = ("You are a sub-agent of a coding agent. The repository's code is below; answer "
              "your task in a few sentences, calling tools when you need more.\n\n")


def _tool(name: str, description: str, **props: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(props)[:1],
                       "properties": {k: {"type": "string", "description": v}
                                      for k, v in props.items()}}}}


SUB_TOOLS = [*TOOLS,
             _tool("grep", "Search the repository for a regular expression.",
                   pattern="a Python regular expression", path="a folder to search"),
             _tool("list_dir", "List a folder of the repository.", path="the folder"),
             _tool("edit_file", "Replace one exact string in a file.", path="the file",
                   old="the text to replace", new="its replacement"),
             _tool("run_tests", "Run the test suite, or one test.", target="a pytest node id")]


def build(args, tokenizer_json) -> dict:
    """Every prompt of the phases asked for; raises ValueError if the text runs out."""
    src = SourceText(tokenizer_json, files=FILES)
    phases = set(args.phases)
    work: dict = {"source_sha256": src.digest}
    if args.warmup_tokens:  # a longer first request: kernels for long prefills get built
        work["warmup_prompt"] = "Warm-up. Read this code:\n" + src.take(args.warmup_tokens)
    if "agentic" in phases:
        work["tool_outputs"] = [src.take_file(args.tool_tokens) for _ in range(args.turns)]
    if "decode" in phases:
        work["decode_prompts"] = ["Continue this file:\n" + src.take(args.decode_prompt_tokens)
                                  for _ in range(args.repeats)]
    for n in args.streams:
        if f"streams{n}" in phases:
            work[f"streams{n}"] = [[f"Stream {i}. Explain this code:\n" + src.take(
                STREAM_PROMPT_TOKENS[i % len(STREAM_PROMPT_TOKENS)]) for i in range(n)]
                for _ in range(args.repeats)]
    if "stall" in phases:
        work["stall_streams"] = [f"Stream {i}. Rewrite this code:\n" + src.take(128)
                                 for i in range(args.stall_streams)]
        work["stall_prompt"] = "Summarise this code:\n" + src.take(args.stall_prompt_tokens)
    if "subagents" in phases:
        def prefix() -> str:
            return SUB_SYSTEM + src.take(args.sub_prefix_tokens)

        def tasks(n: int, tag: str) -> list[str]:
            return [f"Sub-task {tag}{i}: find the bug in this code and explain it.\n"
                    + src.take(args.sub_task_tokens) for i in range(n)]

        n = args.sub_agents
        work["sub"] = {"alone": (prefix(), tasks(1, "a")), "staggered": (prefix(), tasks(n, "s")),
                       "together": (prefix(), tasks(n, "t"))}
    return work


def sub_body(model: str | None, system: str, task: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": task}],
            "tools": SUB_TOOLS, "max_tokens": max_tokens, "temperature": 0.0}
    return body if model is None else {"model": model, **body}


def user_body(model: str | None, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0}
    return body if model is None else {"model": model, **body}


def timed_stream(base_url: str, body: dict, timeout_s: float,
                 stop: threading.Event | None = None,
                 started: threading.Event | None = None, started_after: int = 1) -> dict:
    """One streamed chat on its own connection: every token chunk's arrival time. ``stop``
    set: the client closes the stream (the server should cancel). ``started`` is set once
    ``started_after`` chunks have arrived."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    usage, finish, error, closed = None, None, None, False
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client, \
                client.stream("POST", base_url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                detail = response.read().decode(errors="replace")[:500]
                return {"error": f"HTTP {response.status_code}: {detail}",
                        "status_code": response.status_code, "t_start": t0, "times": []}
            for line in response.iter_lines():
                if time.perf_counter() - t0 > timeout_s:
                    error = f"request exceeded its {timeout_s:.0f} s deadline"
                    break
                if stop is not None and stop.is_set():
                    closed = True
                    break
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or any(delta.get(k) for k in
                                                   ("reasoning", "reasoning_content",
                                                    "tool_calls")):
                        times.append(time.perf_counter())
                        if started is not None and len(times) >= started_after:
                            started.set()
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        error = f"{type(err).__name__}: {err}"
    usage = usage or {}
    return {"t_start": t0, "t_end": time.perf_counter(), "times": times,
            "ttft_s": times[0] - t0 if times else None, "closed_by_client": closed,
            "error": error, "finish_reason": finish, "token_chunks": len(times),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def accepts_ignore_eos(base_url: str, model: str | None, timeout_s: float) -> bool:
    """Whether the server takes ``ignore_eos`` (vLLM's extension): a 2-token probe."""
    body = {**user_body(model, "Say hello.", 2), "ignore_eos": True}
    result = timed_stream(base_url, body, timeout_s)
    return result.get("status_code") not in (400, 422)
