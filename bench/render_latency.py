"""How long long prompts wait in the worker's API process before the engine sees them.

Sub-agents and agentic sessions send long prompts that share most of their text. Each is
parsed, rendered through the chat template and tokenized in the API process before it is
handed to the engine (the access line's ``submit_s``; ``parse_s`` / ``render_s`` split it
where the code logs them). This sends, each round: one request alone with a new shared
prefix (``--prefix-words`` random words as the system prompt), then ``--requests`` at once
with the same prefix (``--cold``: another new one, which none of them has tokenized) and their
own ``--task-words`` task (released together, one thread and
connection each), to a real ``plimsoll launch`` on ``--model`` (default: the tiny demo,
built once under ``--dir``). Each client gives up after ``--wait-s`` (the prefills are
not what is measured here; a client that leaves is cancelled), and the figures are read
from the worker's access lines. ``--before-code DIR`` runs the same rounds against the
sources in DIR (PYTHONPATH), interleaved with the tree's own. Run with OpenBLAS::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      PYTHONPATH=python python bench/render_latency.py --before-code /tmp/before/python
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shlex
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from lib import access, report, servers

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "file",
         "reader", "returns", "every", "value", "of", "each", "class", "import", "function",
         "module", "test", "case"]
LAUNCH = ("{python} -m plimsoll.cli launch {model} --host {host} --port {port} "
          "--concurrency 8 --context 40960 --max-tokens 8")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def send(url: str, model: str, system: str, task: str, wait_s: float,
         barrier: threading.Barrier | None = None) -> None:
    body = {"model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": task}]}
    with httpx.Client() as client:  # made before the release (tens of ms under the GIL)
        if barrier is not None:
            barrier.wait(timeout=60)
        # past wait_s the client leaves; the worker cancels it and writes its access line
        with contextlib.suppress(httpx.TimeoutException):
            client.post(url + "/v1/chat/completions", json=body, timeout=wait_s)


def access_figures(log: Path, skip: int) -> tuple[list[dict], int]:
    """The access lines' times after the first ``skip`` lines, and the count of lines."""
    got = access.lines(log)
    return got[skip:], len(got)


def run(args) -> dict:
    model = args.model
    if model is None:
        from plimsoll.demo.model import build_demo_model
        model = build_demo_model(args.dir / "tiny", preset="tiny")
    variants = {"plimsoll": None}
    if args.before_code is not None:
        variants["plimsoll before"] = args.before_code
    started = {}
    for label, code in variants.items():
        port = servers.free_port()
        argv = shlex.split(servers.render(LAUNCH, {"python": sys.executable, "model": str(model),
                                                   "host": servers.HOST, "port": str(port)}))
        env = servers.server_env(args.preload)
        if code is not None:  # the sources in DIR first on the path, in the worker's processes
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code),
                                                              env.get("PYTHONPATH")]))
        log = args.dir / "logs" / f"{label.replace(' ', '-')}-{port}.log"
        started[label] = servers.ServerProcess(label, argv, env, port, log).start()
    names = {}
    for label, s in started.items():
        s.wait_ready(300)
        names[label] = servers.served_model(s.base_url, model)
    rng = random.Random(args.seed)
    seen = {label: 0 for label in started}
    out: dict = {label: {"alone": [], "together": []} for label in started}
    try:
        for r in range(args.rounds):
            for label, s in started.items():  # interleaved: a drifting load hits both alike
                system = words(rng, args.prefix_words)
                send(s.base_url, names[label], system, words(rng, args.task_words), args.wait_s)
                time.sleep(0.5)
                if args.cold:  # the ones at once share a system prompt nobody has sent
                    system = words(rng, args.prefix_words)
                barrier = threading.Barrier(args.requests)
                tasks = [words(rng, args.task_words) for _ in range(args.requests)]
                with ThreadPoolExecutor(args.requests) as pool:
                    list(pool.map(send, [s.base_url] * args.requests,
                                  [names[label]] * args.requests, [system] * args.requests,
                                  tasks, [args.wait_s] * args.requests,
                                  [barrier] * args.requests))
                time.sleep(1.0)  # the cancelled requests' lines
                figs, seen[label] = access_figures(s.log_path, seen[label])
                if figs:
                    out[label]["alone"].append(figs[0])
                    out[label]["together"] += figs[1:]
                print(f"round {r} {label}: alone {figs[:1]}, together submit_s "
                      f"{sorted(f.get('submit_s', 0) for f in figs[1:])}", flush=True)
    finally:
        for s in started.values():
            s.stop(20)
    return out


def summary(runs: dict) -> dict:
    def med(xs):
        return statistics.median(xs) if xs else None
    out = {}
    for label, r in runs.items():
        row = {}
        for phase in ("alone", "together"):
            for key in ("parse_s", "render_s", "submit_s"):
                xs = [f[key] for f in r[phase] if key in f]
                row[f"{phase}_{key}_median"] = med(xs)
                row[f"{phase}_{key}_max"] = max(xs) if xs else None
        out[label] = row
    return out


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [*report.heading("Time in the API process before the engine", result),
             f"Each round: one request alone with a new {a['prefix_words']}-word system prompt "
             f"(~{result.get('prompt_tokens', '?')} tokens with its task), then "
             f"{a['requests']} at once with "
             f"{'another new' if a.get('cold') else 'the same'} system prompt and their own "
             f"{a['task_words']}-word task; {a['rounds']} rounds, medians (max) over every "
             "request. From the worker's access lines: `parse_s` body read and parsed, "
             "`render_s` the template rendered and the prompt tokenized, `submit_s` handed to "
             "the engine (all from arrival; `render_s` a duration).", ""]
    rows = []
    base = result["summary"].get("plimsoll before", {})
    for label, s in result["summary"].items():
        for phase in ("alone", "together"):
            sub = s.get(f"{phase}_submit_s_median")
            ref = base.get(f"{phase}_submit_s_median")
            rows.append([label, phase, report.num(s.get(f"{phase}_parse_s_median")),
                         report.num(s.get(f"{phase}_render_s_median")),
                         f"{report.num(sub)} ({report.num(s.get(f'{phase}_submit_s_max'))})",
                         report.num(sub / ref) if sub and ref else "–"])
    lines += report.table(["code", "requests", "parse_s", "render_s", "submit_s (max)",
                           "× before"], rows)
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: tiny demo)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/render-latency"))
    ap.add_argument("--prefix-words", type=int, default=9000, help="~16k tokens of the demo's")
    ap.add_argument("--task-words", type=int, default=300)
    ap.add_argument("--requests", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wait-s", type=float, default=4.0)
    ap.add_argument("--cold", action="store_true",
                    help="the requests at once share a new system prompt, not the alone one's "
                         "(sub-agents started together)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--before-code", type=Path, default=None)
    ap.add_argument("--preload", default=servers.OPENBLAS if os.path.exists(servers.OPENBLAS)
                    else "")
    report.output_args(ap, "render-latency")
    args = ap.parse_args()
    return report.measure_and_write(
        args, "render-latency", run, markdown, key="runs",
        more=lambda runs: {"summary": summary(runs),
                           "prompt_tokens": max((f.get("prompt", 0) for r in runs.values()
                                                 for f in r["alone"]), default=None)})


if __name__ == "__main__":
    sys.exit(main())
