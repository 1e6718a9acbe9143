"""Clustered mode: tokens/s of a demo model served on one rank vs split over two, same run.

Issue 8, "closing note". For each preset (``tiny``: 4 layers, tied head; ``hybrid``:
qwen3_next, 8 layers, every 4th full attention, MoE) it builds (or reuses) the demo model,
then:

1. **per-rank admission figures** from ``plimsoll cluster plan --json`` for the two-rank
   split (layers, weights share from the safetensors headers, communication buffers, KV
   bytes per token, pool blocks, footprint, ``u``) — the same pure plan the ranks make;
2. starts, side by side on 127.0.0.1, the model on **one rank** and on **two ranks**
   (``Cluster`` with rank 0 serving the worker API, ring backend, OpenBLAS preloaded), each
   rank with its own figures on its command line, and after one warm-up request per
   cluster alternates, ``--repeats`` times (order flipped every repeat):
   - **single stream**: one streamed completion of ``--tokens`` tokens at temperature 0;
     decode tokens/s = (completion − 1) ÷ (last chunk − first chunk), TTFT excluded;
   - **two at once**: two such streams released together (the committed concurrency is
     2); aggregate tokens/s = all completion tokens ÷ wall time (prefill included).
   The medians and the ratio two-rank ÷ one-rank are reported.

What to expect: the demo models are tiny, so a token is latency-bound. A layer split
adds, per token, a header and an activation message per rank boundary and the token's
message back to rank 0 (TCP on 127.0.0.1), each of which must wake the other process;
on a shared 2-core box those wake-ups dominate. The split buys memory (each rank holds
only its share), not speed, at this size. The host's load average is recorded with the
figures (other work on the box moves them).

Writes bench/results/cluster_tps.{json,md}. Run (from the repo root):
    /work/venv/bin/python bench/cluster_tps.py [--presets tiny hybrid] [--repeats 3]
Every request has a timeout and every wait a deadline; traffic goes only to 127.0.0.1; the
clusters are closed (every rank by pid) before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
GIB = 1 << 30
#: two-rank figures per preset (GiB ceilings): even for tiny (2 + 2 layers), 6 + 2 for hybrid
SPLITS = {"tiny": (4, 4), "hybrid": (6, 2)}
PROMPT = "def main():\n    print('hello')\n"


def env() -> dict[str, str]:
    out = dict(os.environ)
    if os.path.exists(OPENBLAS) and "LD_PRELOAD" not in out:
        out["LD_PRELOAD"] = OPENBLAS
    return out


def plan_figures(model: Path, ceilings: tuple[float, ...]) -> dict:
    argv = [sys.executable, "-m", "plimsoll.cli", "cluster", "plan", str(model), "--json",
            "--concurrency", "2", "--context", "2048", "--max-tokens", "512"]
    for c in ceilings:
        argv += ["--rank", str(c)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    data = json.loads(out.stdout)
    ranks = []
    for a in data["ranks"]:
        p, d = a["plan"], a["decision"]
        ranks.append({"rank": a["rank"], "layers": [p["layer_start"], p["layer_end"]],
                      "weights_bytes": p["weights_bytes"], "comm_bytes": p["comm_bytes"],
                      "kv_bytes_per_token": p["kv_bytes_per_token"],
                      "per_sequence_fixed_bytes": p["per_sequence_fixed_bytes"],
                      "pool_blocks": d["pool_blocks"], "footprint_bytes": d["footprint_bytes"],
                      "u": d["gpu_memory_utilization"], "ceiling_bytes": d["ceiling_bytes"]})
    return {"ranks": ranks, "decision": data["decision"]["action"]}


def stream(url: str, tokens: int) -> dict:
    """One streamed completion: completion tokens, first/last chunk times, end time."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, last, usage = time.perf_counter(), None, None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("usage"):
                usage = event["usage"]
            if any(c.get("text") for c in event.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
    n = usage["completion_tokens"]
    return {"tokens": n, "start": start, "first": first, "last": last,
            "end": time.perf_counter(),
            "decode_tps": (n - 1) / (last - first) if n > 1 and last > first else None}


def together(url: str, tokens: int, k: int = 2) -> dict:
    results: list[dict] = [{}] * k
    go = threading.Barrier(k)

    def run(i: int) -> None:
        go.wait(30)
        results[i] = stream(url, tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    total = sum(r["tokens"] for r in results)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"tokens": total, "wall_s": wall, "aggregate_tps": total / wall}


def measure(preset: str, model: Path, repeats: int, tokens: int) -> dict:
    from plimsoll.cluster.plan import ClusterRequest
    from plimsoll.cluster.runner import Cluster, RankSpec, ServeSpec
    from plimsoll.web.serve import free_port

    request = ClusterRequest(concurrency=2, context=2048, max_tokens=512, min_context=1024)
    splits = {"one_rank": (4,), "two_ranks": SPLITS[preset]}
    clusters = {}
    try:
        for name, ceilings in splits.items():
            specs = [RankSpec(ceiling_bytes=int(c * GIB), total_ram_bytes=int(c * GIB),
                              budget_bytes=int(c * GIB)) for c in ceilings]
            c = Cluster(model, specs, request, env=env(),
                        serve=ServeSpec(port=free_port(), model_name=preset))
            clusters[name] = c
            c.start(timeout=180)
            stream(c.serving["url"], 8)  # warm-up
        runs: dict[str, dict[str, list]] = {n: {"single": [], "two": []} for n in clusters}
        for i in range(repeats):
            order = list(clusters) if i % 2 == 0 else list(reversed(clusters))
            for name in order:
                url = clusters[name].serving["url"]
                runs[name]["single"].append(stream(url, tokens))
                runs[name]["two"].append(together(url, tokens))
        ready = {name: [c.ready[r] for r in sorted(c.ready)] for name, c in clusters.items()}
    finally:
        for c in clusters.values():
            c.close()
    out = {}
    for name, r in runs.items():
        decode = [x["decode_tps"] for x in r["single"] if x["decode_tps"]]
        out[name] = {
            "ranks": len(splits[name]),
            "single_stream_decode_tps": statistics.median(decode) if decode else None,
            "two_streams_aggregate_tps": statistics.median(x["aggregate_tps"] for x in r["two"]),
            "completion_tokens": [x["tokens"] for x in r["single"]],
            "loaded": [{"rank": e["rank"], "layers": e["layers"],
                        "loaded_bytes": e["loaded_bytes"]} for e in ready[name]],
            "runs": {"single": r["single"], "two": r["two"]},
        }
    one, two = out["one_rank"], out["two_ranks"]
    out["ratio_two_over_one"] = {
        "single_stream_decode": (two["single_stream_decode_tps"] / one["single_stream_decode_tps"]
                                 if one["single_stream_decode_tps"] else None),
        "two_streams_aggregate": two["two_streams_aggregate_tps"]
        / one["two_streams_aggregate_tps"]}
    return out


def markdown(result: dict) -> str:
    lines = [f"# Clustered mode: one rank vs two ranks ({result['host']})", "",
             (f"{result['when']}; {result['repeats']} repeats, {result['tokens']} tokens per "
             "stream, temperature 0, concurrency 2, context 2048; ring backend on 127.0.0.1, "
             "every rank a process with its own figures."), "",
             "| model | ranks | single-stream decode tok/s | two streams aggregate tok/s |",
             "|---|---|---|---|"]
    for preset, r in result["presets"].items():
        for name in ("one_rank", "two_ranks"):
            x = r["tps"][name]
            single = x["single_stream_decode_tps"]
            lines.append(f"| {preset} | {x['ranks']} | "
                         f"{single:.1f} | {x['two_streams_aggregate_tps']:.1f} |"
                         if single else f"| {preset} | {x['ranks']} | – | "
                         f"{x['two_streams_aggregate_tps']:.1f} |")
        ratio = r["tps"]["ratio_two_over_one"]
        lines.append(f"| {preset} | **2 ÷ 1** | **{ratio['single_stream_decode']:.2f}** | "
                     f"**{ratio['two_streams_aggregate']:.2f}** |")
    lines += ["", "## Per-rank admission (two ranks; `plimsoll cluster plan --json`)", "",
              ("| model | rank | layers | weights B | comm B | KV B/token | fixed B/seq | "
              "pool blocks | footprint B | u |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for preset, r in result["presets"].items():
        for x in r["plan"]["ranks"]:
            lines.append(f"| {preset} | {x['rank']} | {x['layers'][0]}..{x['layers'][1] - 1} | "
                         f"{x['weights_bytes']} | {x['comm_bytes']} | {x['kv_bytes_per_token']}"
                         f" | {x['per_sequence_fixed_bytes']} | {x['pool_blocks']} | "
                         f"{x['footprint_bytes']} | {x['u']:.3f} |")
    load = result.get("loadavg")
    lines += ["", ("Each rank loads exactly its planned weights share (`loaded_bytes` in the "
              "JSON); with a tied head the last rank holds the embedding matrix again."),
              ("A tiny model is latency-bound: per token the split adds a header and an "
               "activation message per rank boundary and the token's message back to rank 0, "
               "each a wake-up of another process, and the ranks share two CPU cores with "
               "whatever else runs, so the ratio is below 1; the split buys memory per host, "
               "not speed.")
              + (f" Load average (1 min) at start/end: {load['start']:.1f}/{load['end']:.1f}."
                 if load else "")]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "hybrid"], choices=sorted(SPLITS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", type=Path, default=HERE / "out" / "cluster-models")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--render-only", action="store_true",
                    help="Rewrite the .md from the existing .json (no measurement).")
    args = ap.parse_args()
    if args.render_only:
        result = json.loads((args.out / "cluster_tps.json").read_text())
        (args.out / "cluster_tps.md").write_text(markdown(result))
        return
    from plimsoll.demo.model import build_demo_model

    result = {"host": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "repeats": args.repeats, "tokens": args.tokens, "presets": {},
              "loadavg": {"start": os.getloadavg()[0]}}
    for preset in args.presets:
        model = args.models / preset
        if not (model / "config.json").exists():
            build_demo_model(model, preset=preset)
        print(f"{preset}: planning and measuring", file=sys.stderr, flush=True)
        result["presets"][preset] = {
            "plan": plan_figures(model, SPLITS[preset]),
            "tps": measure(preset, model, args.repeats, args.tokens)}
    result["loadavg"]["end"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster_tps.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "cluster_tps.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
