"""Clustered mode: tokens/s of a demo model served on one rank vs split over two, same run.

For each preset (``tiny``: 4 layers, tied head; ``hybrid``:
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

Writes ``--out-dir``/``--name``.{json,md}. Run (from the repo root):
    python bench/cluster.py [--presets tiny hybrid] [--repeats 3]
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
import time
from pathlib import Path

from lib import report
from lib.servers import OPENBLAS, server_env
from lib.workloads import concurrent_streams, decode_tps, timed_stream

GIB = 1 << 30
#: two-rank figures per preset (GiB ceilings): even for tiny (2 + 2 layers), 6 + 2 for hybrid
SPLITS = {"tiny": (4, 4), "hybrid": (6, 2)}
PROMPT = "def main():\n    print('hello')\n"


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
    """One streamed completion at temperature 0: tokens, decode tok/s after the first."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    r = timed_stream(url, body, 300, path="/v1/completions")
    if r["error"]:
        raise RuntimeError(r["error"])
    return {"tokens": r["completion_tokens"], "ttft_s": r["ttft_s"], "decode_tps": decode_tps(r)}


def together(url: str, tokens: int, k: int = 2) -> dict:
    """``k`` such streams released together: aggregate tok/s, prefill included."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    r = concurrent_streams(url, [body] * k, 300, path="/v1/completions")
    if r["completed"] < k:
        raise RuntimeError(f"{k - r['completed']} of {k} streams failed: {r['errors']}")
    return {"tokens": r["completion_tokens"], "wall_s": r["wall_s"],
            "aggregate_tps": r["aggregate_tps"]}


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
            c = Cluster(model, specs, request, env=server_env(OPENBLAS),
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
    rows = []
    for preset, r in result["presets"].items():
        for name in ("one_rank", "two_ranks"):
            x = r["tps"][name]
            rows.append([preset, x["ranks"], report.num(x["single_stream_decode_tps"], ".1f"),
                         report.num(x["two_streams_aggregate_tps"], ".1f")])
        ratio = r["tps"]["ratio_two_over_one"]
        rows.append([preset, "**2 ÷ 1**", f"**{report.num(ratio['single_stream_decode'], '.2f')}**",
                     f"**{report.num(ratio['two_streams_aggregate'], '.2f')}**"])
    plan = [[preset, x["rank"], f"{x['layers'][0]}..{x['layers'][1] - 1}", x["weights_bytes"],
             x["comm_bytes"], x["kv_bytes_per_token"], x["per_sequence_fixed_bytes"],
             x["pool_blocks"], x["footprint_bytes"], f"{x['u']:.3f}"]
            for preset, r in result["presets"].items() for x in r["plan"]["ranks"]]
    load = result.get("loadavg")
    return "\n".join([
        f"# Clustered mode: one rank vs two ranks ({result['host']})", "",
        *([f"Command: `{result['command']}`", ""] if result.get("command") else []),
        (f"{result['when']}; {result['repeats']} repeats, {result['tokens']} tokens per "
         "stream, temperature 0, concurrency 2, context 2048; ring backend on 127.0.0.1, "
         "every rank a process with its own figures."), "",
        *report.table(["model", "ranks", "single-stream decode tok/s",
                       "two streams aggregate tok/s"], rows),
        "", "## Per-rank admission (two ranks; `plimsoll cluster plan --json`)", "",
        *report.table(["model", "rank", "layers", "weights B", "comm B", "KV B/token",
                       "fixed B/seq", "pool blocks", "footprint B", "u"], plan),
        "", ("Each rank loads exactly its planned weights share (`loaded_bytes` in the "
             "JSON); with a tied head the last rank holds the embedding matrix again."),
        ("A tiny model is latency-bound: per token the split adds a header and an "
         "activation message per rank boundary and the token's message back to rank 0, "
         "each a wake-up of another process, and the ranks share the CPU cores with "
         "whatever else runs, so the ratio is below 1; the split buys memory per host, "
         "not speed.")
        + (f" Load average (1 min) at start/end: {load['start']:.1f}/{load['end']:.1f}."
           if load else "")]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "hybrid"], choices=sorted(SPLITS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", type=Path, default=report.OUT / "cluster-models")
    report.output_args(ap, "cluster")
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="only rewrite the markdown of an earlier run's JSON (beside it)")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(result))
        return 0
    from plimsoll.demo.model import build_demo_model

    result = {"command": report.command(),
              "host": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
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
    report.write(result, args.out_dir, args.name or report.default_name("cluster"), markdown)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
