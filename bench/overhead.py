"""The serving stack's Python overhead per decode step: engine in process vs worker over HTTP.

By hand, not a test (issue 14's throughput gap: the engine kernel path matches mlx-lm's
BatchGenerator in process, yet the worker over HTTP lost half of it on the H200). On a model
so small (``bench/gpu_model.py --shape micro``: 2 layers, hidden 128) that the model's compute
is a fraction of a step, this measures at 1, 8 and 32 concurrent streams × ``--tokens``:

- ``engine``: :class:`plimsoll.engine.Engine` in this process, pipelined Steps (as
  bench/engine_paged.py: ``run_async`` of step n+1 before ``result()`` of step n), block
  tables as a fresh pool hands them out (lowest ids first); no scheduler, no HTTP;
- ``plimsoll``: the worker (``plimsoll launch`` by default) over HTTP streaming on 127.0.0.1;
- ``mlx``: ``mlx_lm.server`` (defaults) over HTTP, same requests, same run.

Clients: one asyncio loop in this process, one httpx connection per stream, all released
together, chat completions streamed with ``stream_options.include_usage``. Figures per
server and stream count (median over ``--rounds``):

- ``aggregate_tps``: completion tokens ÷ wall time from the first send to the last end;
- ``decode_tps``: tokens after each stream's first ÷ (last token − earliest first token);
- ``step_ms``: the median stream's time between tokens, (last − first) ÷ (tokens − 1) — the
  server's decode step as a client sees it; the engine's is rows ÷ its tok/s;
- ``overhead_ms``: server ``step_ms`` − engine ``step_ms``: what the serving stack adds per
  step (scheduler, event delivery, SSE, HTTP).

``--py-spy DIR`` also records the plimsoll worker with py-spy (every thread, ``--idle``
off, speedscope and a flat top list in DIR) during its widest phase, for where the time
goes. Results: ``--out-dir``/``--name``.{json,md}. Typical CPU run (OpenBLAS preloaded)::

    python bench/gpu_model.py /tmp/perf/micro --shape micro --dtype float32 --tokenizer-vocab 4096
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 PYTHONPATH=python \\
      python bench/overhead.py --model /tmp/perf/micro --name overhead-cpu

On the GPU (after bench/gpu_run.sh built the model): ``PHASES=overhead bash bench/gpu_run.sh``
runs it on the Qwen3-4B-shaped model (see bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness_server import HOST, ServerProcess, free_port, render  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing "
         "matches near the old river bank and count their golden coins").split()
PLIMSOLL = ("{python} -m plimsoll.cli launch {model} --host {host} --port {port} "
            "--concurrency 32 --context 2048 --max-tokens 512")
MLX = "{python} -m mlx_lm server --model {model} --host {host} --port {port}"
BLOCK = 16


def prompt_text(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words)) + f" ({i})"


# --- the engine, in process ------------------------------------------------------------------
def engine_rounds(model: Path, streams: list[int], tokens: int, rounds: int,
                  words: int) -> dict:
    import mlx.core as mx

    from plimsoll.engine import Engine
    from plimsoll.engine.work import Step, Work

    prompts_by_n: dict[int, list[list[int]]] = {}
    out: dict = {}
    need = max(streams) * (-(-(words * 3 + tokens + 64) // BLOCK))
    eng = Engine.load(model, block_tokens=BLOCK, max_blocks=need)
    out["device"] = str(mx.default_device())
    tok = eng.tokenizer
    for n in streams:
        prompts_by_n[n] = [tok.apply_chat_template(
            [{"role": "user", "content": prompt_text(i, words)}], add_generation_prompt=True)
            for i in range(n)]

    def one(prompts: list[list[int]]) -> float:
        tables, at = [], 0
        for p in prompts:  # consecutive ids, as a fresh pool's heap hands them out
            nb = -(-(len(p) + tokens) // BLOCK)
            tables.append(tuple(range(at, at + nb)))
            at += nb
        for i, p in enumerate(prompts):
            eng.run(Step(prefills=(Work(i, tuple(p), 0, tables[i], True),)))
        t0 = time.perf_counter()
        pending, count = None, 0
        for k in range(tokens - 1):
            nxt = eng.run_async(Step(decodes=tuple(
                Work(i, None, len(p) + k, tables[i], True) for i, p in enumerate(prompts))))
            if pending is not None:
                count += len(pending.result())
            pending = nxt
        count += len(pending.result())
        dt = time.perf_counter() - t0
        for i in range(len(prompts)):
            eng.free_state(i)
        return count / dt

    one(prompts_by_n[streams[0]][:1])  # warm-up
    for n in streams:
        runs = sorted(one(prompts_by_n[n]) for _ in range(rounds))
        tps = runs[len(runs) // 2]
        out[str(n)] = {"decode_tps": tps, "runs_tps": runs, "step_ms": 1000 * n / tps}
        print(f"[engine] {n} rows: {tps:.0f} tok/s, {1000 * n / tps:.2f} ms/step", flush=True)
    del eng
    return out


# --- a server over HTTP ------------------------------------------------------------------------
async def stream_one(client: httpx.AsyncClient, url: str, body: dict, go: asyncio.Event,
                     timeout_s: float) -> dict:
    await go.wait()
    t0 = time.perf_counter()
    times: list[float] = []
    usage, error = None, None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        times.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        error = f"{type(err).__name__}: {err}"
    tokens = (usage or {}).get("completion_tokens") or len(times)
    return {"t0": t0, "t_end": time.perf_counter(), "first": times[0] if times else None,
            "last": times[-1] if times else None, "tokens": tokens, "chunks": len(times),
            "error": error}


async def concurrent(base: str, model_id: str, prompts: list[str], tokens: int,
                     timeout_s: float) -> dict:
    go = asyncio.Event()
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        tasks = [asyncio.create_task(stream_one(
            client, base + "/v1/chat/completions",
            {"model": model_id, "messages": [{"role": "user", "content": p}],
             "max_tokens": tokens, "temperature": 0.0, "stream": True,
             "stream_options": {"include_usage": True}}, go, timeout_s)) for p in prompts]
        await asyncio.sleep(0.05)
        go.set()
        got = await asyncio.gather(*tasks)
    ok = [g for g in got if not g["error"] and g["first"] is not None]
    out = {"streams": len(prompts), "completed": len(ok),
           "errors": [g["error"] for g in got if g["error"]][:3]}
    if not ok:
        return out
    total = sum(g["tokens"] for g in ok)
    wall = max(g["t_end"] for g in ok) - min(g["t0"] for g in ok)
    span = max(g["last"] for g in ok) - min(g["first"] for g in ok)
    steps = sorted((g["last"] - g["first"]) / (g["tokens"] - 1) for g in ok if g["tokens"] > 1)
    out |= {"completion_tokens": total, "tokens_each_min": min(g["tokens"] for g in ok),
            "aggregate_tps": total / wall, "decode_tps": (total - len(ok)) / span if span else None,
            "step_ms": 1000 * steps[len(steps) // 2] if steps else None,
            "ttft_max_s": max(g["first"] - g["t0"] for g in ok)}
    return out


def served_model(base: str, model_dir: Path) -> str:
    """The id to send: the server's only model, else the directory (mlx_lm.server's
    /v1/models fails without a hub cache directory; it serves its --model by path)."""
    try:
        ids = [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        ids = []
    return ids[0] if len(ids) == 1 else str(model_dir)


def run_server(label: str, template: str, args, prompts: dict[int, list[list[str]]]) -> dict:
    port = free_port()
    values = {"python": sys.executable, "model": str(args.model), "host": HOST, "port": str(port)}
    argv = shlex.split(render(template, values))
    env = dict(os.environ)
    if args.preload and Path(args.preload).exists():
        env["LD_PRELOAD"] = args.preload
    server = ServerProcess(label, argv, env, port, args.out_dir / "logs" / f"{label}-{port}.log")
    out: dict = {"argv": argv, "loadavg_start": os.getloadavg()}
    print(f"[{label}] starting {shlex.join(argv)}", flush=True)
    server.start()
    try:
        out["ready_s"] = server.wait_ready(args.ready_timeout)
        model_id = served_model(server.base_url, args.model)
        for _ in range(2):  # warm-up: mlx_lm.server loads lazily; both compile their kernels
            asyncio.run(concurrent(server.base_url, model_id, ["warm up " * 8] * 2, 16, 120))
        for n in args.streams:
            spy = None
            if args.py_spy and label == "plimsoll" and n == max(args.streams):
                spy = start_spy(server, args.py_spy, f"{label}-{n}")
            runs = [asyncio.run(concurrent(server.base_url, model_id, prompts[n][r],
                                           args.tokens, args.request_timeout))
                    for r in range(args.rounds)]
            if spy is not None:
                out[f"py_spy_{n}"] = stop_spy(spy)
            out[str(n)] = summarise(runs)
            s = out[str(n)]
            print(f"[{label}] {n} streams: {s.get('aggregate_tps', 0):.0f} tok/s aggregate, "
                  f"{s.get('step_ms') or 0:.2f} ms/step, min tokens {s.get('tokens_each_min')} "
                  f"{s.get('errors') or ''}", flush=True)
    except Exception as err:  # recorded: the other server still runs
        out["error"] = f"{type(err).__name__}: {err}"
        print(f"[{label}] error: {out['error']}", flush=True)
    finally:
        out["stop"] = server.stop()
        out["loadavg_end"] = os.getloadavg()
    return out


def summarise(runs: list[dict]) -> dict:
    def med(key: str):
        vals = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {"aggregate_tps": med("aggregate_tps"), "decode_tps": med("decode_tps"),
            "step_ms": med("step_ms"), "ttft_max_s": med("ttft_max_s"),
            "tokens_each_min": min((r.get("tokens_each_min") or 0) for r in runs),
            "completed": min(r.get("completed", 0) for r in runs),
            "errors": [e for r in runs for e in r.get("errors", [])][:3], "runs": runs}


def start_spy(server: ServerProcess, out_dir: Path, name: str):
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out_dir.mkdir(parents=True, exist_ok=True)
    server.remember_tree()
    pid = max(server._known)  # the worker: the newest process of the tree (launch's child)
    path = out_dir / f"{name}.txt"
    proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--threads", "--rate", "250",
                             "--format", "raw", "--nonblocking", "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    return proc, path


def stop_spy(spy) -> str:
    proc, path = spy
    proc.send_signal(2)
    proc.wait(timeout=30)
    return str(path)


# --- report ------------------------------------------------------------------------------------
def ratios(result: dict, streams: list[int]) -> dict:
    out = {}
    eng, plim, mlx = (result.get(k, {}) for k in ("engine", "plimsoll", "mlx"))
    for n in streams:
        k = str(n)
        e, p, m = eng.get(k, {}), plim.get(k, {}), mlx.get(k, {})
        row = {}
        if p.get("aggregate_tps") and m.get("aggregate_tps"):
            row["plimsoll_over_mlx_aggregate"] = p["aggregate_tps"] / m["aggregate_tps"]
        if p.get("decode_tps") and m.get("decode_tps"):
            row["plimsoll_over_mlx_decode"] = p["decode_tps"] / m["decode_tps"]
        if p.get("decode_tps") and e.get("decode_tps"):
            row["plimsoll_over_engine_decode"] = p["decode_tps"] / e["decode_tps"]
        for label, s in (("plimsoll", p), ("mlx", m)):
            if s.get("step_ms") and e.get("step_ms"):
                row[f"{label}_overhead_ms"] = s["step_ms"] - e["step_ms"]
        out[k] = row
    return out


def markdown(result: dict, streams: list[int]) -> str:
    def f(x, fmt="{:.0f}"):
        return "–" if x is None else fmt.format(x)

    lines = [f"# Serving overhead per decode step: {result['name']}", "",
             f"Command: `{result['command']}`", "",
             f"Model {result['model']}; {result['machine']}; mlx {result['mlx_version']}, "
             f"mlx_lm {result['mlx_lm_version']}; {result['tokens']} tokens a stream, "
             f"{result['rounds']} rounds (medians); load average at start "
             f"{result['loadavg_start']}.", "",
             "| streams | engine tok/s | engine ms/step | plimsoll agg tok/s | plimsoll decode "
             "tok/s | plimsoll ms/step | mlx_lm.server agg tok/s | mlx decode tok/s | "
             "mlx ms/step | plimsoll ÷ mlx (agg) | plimsoll ÷ mlx (decode) | plimsoll overhead "
             "ms/step | mlx overhead ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in streams:
        k = str(n)
        e = result.get("engine", {}).get(k, {})
        p = result.get("plimsoll", {}).get(k, {})
        m = result.get("mlx", {}).get(k, {})
        r = result["ratios"].get(k, {})
        lines.append(
            f"| {n} | {f(e.get('decode_tps'))} | {f(e.get('step_ms'), '{:.2f}')} | "
            f"{f(p.get('aggregate_tps'))} | {f(p.get('decode_tps'))} | "
            f"{f(p.get('step_ms'), '{:.2f}')} | {f(m.get('aggregate_tps'))} | "
            f"{f(m.get('decode_tps'))} | {f(m.get('step_ms'), '{:.2f}')} | "
            f"{f(r.get('plimsoll_over_mlx_aggregate'), '{:.2f}')} | "
            f"{f(r.get('plimsoll_over_mlx_decode'), '{:.2f}')} | "
            f"{f(r.get('plimsoll_overhead_ms'), '{:.2f}')} | "
            f"{f(r.get('mlx_overhead_ms'), '{:.2f}')} |")
    for label in ("plimsoll", "mlx"):
        s = result.get(label, {})
        short = [f"{n}: {s.get(str(n), {}).get('tokens_each_min')}" for n in streams]
        lines.append("")
        lines.append(f"{label}: fewest tokens in one stream {', '.join(short)}"
                     + (f"; error {s['error']}" if s.get("error") else ""))
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--modes", default="engine,plimsoll,mlx",
                    help="which of engine, plimsoll, mlx to run, in this order")
    ap.add_argument("--plimsoll-cmd", default=PLIMSOLL)
    ap.add_argument("--mlx-cmd", default=MLX)
    ap.add_argument("--preload",
                    default="/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--name", default="overhead-cpu")
    ap.add_argument("--py-spy", type=Path, default=None, help="record the worker into this dir")
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=600)
    args = ap.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import mlx.core as mx
    import mlx_lm

    result: dict = {"name": args.name, "model": str(args.model), "tokens": args.tokens,
                    "rounds": args.rounds, "streams": args.streams,
                    "command": shlex.join([Path(sys.executable).name, *sys.argv]),
                    "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} "
                               f"CPUs, {mx.default_device()}",
                    "mlx_version": mx.__version__, "mlx_lm_version": mlx_lm.__version__,
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    prompts = {n: [[prompt_text(r * 100 + i, args.prompt_words) for i in range(n)]
                   for r in range(args.rounds)] for n in args.streams}
    for mode in args.modes:
        if mode == "engine":
            result["engine"] = engine_rounds(args.model, args.streams, args.tokens, args.rounds,
                                             args.prompt_words)
        elif mode in ("plimsoll", "mlx"):
            template = args.plimsoll_cmd if mode == "plimsoll" else args.mlx_cmd
            result[mode] = run_server(mode, template, args, prompts)
        else:
            raise SystemExit(f"unknown mode {mode!r}: engine, plimsoll or mlx")
    result["ratios"] = ratios(result, args.streams)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    (args.out_dir / f"{args.name}.md").write_text(markdown(result, args.streams))
    print(markdown(result, args.streams))
    return 0


if __name__ == "__main__":
    sys.exit(main())
