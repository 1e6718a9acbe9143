"""Clustered mode: tokens/s of a demo model served on one rank vs split over two, same run.

For each preset (``tiny``: 4 layers, tied head; ``hybrid``:
qwen3_next, 8 layers, every 4th full attention, MoE) it builds (or reuses) the demo model,
then:

1. **per-rank admission figures** from ``plimsoll cluster plan --json`` for the two-rank
   split (layers, weights share from the safetensors headers, communication buffers, KV
   bytes per token, pool blocks, footprint, ``u``) — the same pure plan the ranks make;
2. for each ``--variants`` stage (``loop``: the per-layer loop; ``engine``: the worker's
   engine, one step at a time through the ranks; ``engine-pipelined``: the engine in two
   micro-batches, the default) starts, all side by side on 127.0.0.1, the model on **one
   rank** and on **two ranks** (``Cluster`` with rank 0 serving the worker API, ring backend,
   OpenBLAS preloaded), each rank with its own figures on its command line, and after one
   warm-up request per cluster goes round every cluster, ``--repeats`` times (the order
   rotated every repeat):
   - **single stream**: one streamed completion of ``--tokens`` tokens at temperature 0;
     decode tokens/s = (completion − 1) ÷ (last chunk − first chunk), TTFT excluded;
   - **k at once**, for each k of ``--together`` (default 2): k such streams released
     together (the committed concurrency is the largest k); aggregate tokens/s = all
     completion tokens ÷ wall time (prefill included).
   The medians and the ratio two-rank ÷ one-rank are reported.

What to expect: the demo models are tiny, so a token is latency-bound. A layer split
adds, per token, a header and an activation message per rank boundary and the token's
message back to rank 0 (TCP on 127.0.0.1), each of which must wake the other process;
on a shared 2-core box those wake-ups dominate. The split buys memory (each rank holds
only its share), not speed, at this size. The host's load average is recorded with the
figures (other work on the box moves them).

Writes ``--out-dir``/``--name``.{json,md}. Run (from the repo root):
    python bench/cluster.py [--presets tiny hybrid] [--repeats 3] \\
        [--variants loop engine engine-pipelined] [--together 8]

**A built model** (``--model DIR``, e.g. bench/gpu_model.py's Qwen3-4B-shaped one on the
GPU: bench/gpu_cluster.sh) runs instead, one after another (``--phases``, in that order;
:mod:`lib.cluster_runs`), every rank a process on this machine with its own slice
(``--rank-gib``: ceiling = total = budget, on its command line, so two ranks sharing one
GPU each admit against their slice, not the device or the host's RAM):

- ``one``: one rank; ``ring``: two ranks over ring on 127.0.0.1; ``nccl``: two ranks over
  MLX's nccl (a refusal, e.g. two ranks on one device, or no CUDA build, is the figure);
  each at ``--streams`` (1, 8, 32) streams of ``--tokens`` tokens released together,
  ``--repeats`` rounds: aggregate tok/s, per-stream decode tok/s, TTFT, and each rank's
  memory against its admitted footprint;
- ``too-big``: a per-rank budget (``--too-big-gib``; ``auto``: halfway between the least
  at which two ranks commit at ``--too-big-streams``' largest concurrency and the least at
  which one rank commits at all, from the pure plan) that one rank refuses (its runtime
  refusal recorded) and two ranks (ring) serve, at ``--too-big-streams``.

The results are rewritten after every run, so a deadline (``--deadline-s``) or a kill keeps
what was measured.
Every request has a timeout and every wait a deadline; traffic goes only to 127.0.0.1; the
clusters are closed (every rank by pid) before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lib import report
from lib.cluster_runs import GIB, least_budget, pure_plan, serve_run
from lib.cluster_runs import markdown as served_markdown
from lib.samplers import Gpu
from lib.servers import OPENBLAS, server_env
from lib.workloads import concurrent_streams, decode_tps, timed_stream

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


def together(url: str, tokens: int, k: int) -> dict:
    """``k`` such streams released together: aggregate tok/s, prefill included."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    r = concurrent_streams(url, [body] * k, 300, path="/v1/completions")
    if r["completed"] < k:
        raise RuntimeError(f"{k - r['completed']} of {k} streams failed: {r['errors']}")
    return {"tokens": r["completion_tokens"], "wall_s": r["wall_s"],
            "aggregate_tps": r["aggregate_tps"]}


#: how the ranks run their layers, by name: (stage, micro-batches)
VARIANTS = {"loop": ("loop", 1), "engine": ("engine", 1), "engine-pipelined": ("engine", 2)}


def measure(preset: str, model: Path, repeats: int, tokens: int, variants: list[str],
            streams: list[int]) -> dict[str, dict]:
    """One rank against two (``SPLITS``) on each of ``variants``' stages: every cluster up
    side by side, the rounds alternating over all of them (so load on the box falls on each
    alike)."""
    from plimsoll.cluster.plan import ClusterRequest
    from plimsoll.cluster.runner import Cluster, RankSpec, ServeSpec
    from plimsoll.web.serve import free_port

    splits = {"one_rank": (4,), "two_ranks": SPLITS[preset]}
    clusters: dict[tuple[str, str], Cluster] = {}
    try:
        for variant in variants:
            stage, micro = VARIANTS[variant]
            request = ClusterRequest(concurrency=max(2, *streams), context=2048,
                                     max_tokens=512, min_context=1024, stage=stage,
                                     micro_batches=micro)
            for name, ceilings in splits.items():
                specs = [RankSpec(ceiling_bytes=int(c * GIB), total_ram_bytes=int(c * GIB),
                                  budget_bytes=int(c * GIB)) for c in ceilings]
                c = Cluster(model, specs, request, env=server_env(OPENBLAS),
                            serve=ServeSpec(port=free_port(), model_name=preset))
                clusters[variant, name] = c
                c.start(timeout=180)
                stream(c.serving["url"], 8)  # warm-up
        runs: dict[tuple[str, str], dict] = {
            key: {"single": [], **{k: [] for k in streams if k > 1}} for key in clusters}
        keys = list(clusters)
        for i in range(repeats):
            shift = i % len(keys)
            for key in keys[shift:] + keys[:shift]:
                url = clusters[key].serving["url"]
                runs[key]["single"].append(stream(url, tokens))
                for k in streams:
                    if k > 1:
                        runs[key][k].append(together(url, tokens, k))
        ready = {key: [c.ready[r] for r in sorted(c.ready)] for key, c in clusters.items()}
    finally:
        for c in clusters.values():
            c.close()
    return {variant: _figures(variant, {name: runs[variant, name] for name in splits},
                              {name: ready[variant, name] for name in splits}, streams)
            for variant in variants}


def _figures(variant: str, runs: dict[str, dict], ready: dict[str, list], streams: list[int]
             ) -> dict:
    """One variant's medians, one rank and two, and the ratio two ÷ one."""
    stage, micro = VARIANTS[variant]
    out: dict = {"stage": stage, "micro_batches": micro}
    for name, r in runs.items():
        decode = [x["decode_tps"] for x in r["single"] if x["decode_tps"]]
        out[name] = {
            "ranks": len(ready[name]),
            "single_stream_decode_tps": statistics.median(decode) if decode else None,
            "single_stream_ttft_s": statistics.median(x["ttft_s"] for x in r["single"]),
            "aggregate_tps": {str(k): statistics.median(x["aggregate_tps"] for x in r[k])
                              for k in streams if k > 1},
            "completion_tokens": [x["tokens"] for x in r["single"]],
            "loaded": [{"rank": e["rank"], "layers": e["layers"], "stage": e.get("stage"),
                        "loaded_bytes": e["loaded_bytes"]} for e in ready[name]],
            "runs": {str(k): v for k, v in r.items()},
        }
    one, two = out["one_rank"], out["two_ranks"]
    out["ratio_two_over_one"] = {
        "single_stream_decode": (two["single_stream_decode_tps"] / one["single_stream_decode_tps"]
                                 if one["single_stream_decode_tps"] else None),
        "aggregate": {k: two["aggregate_tps"][k] / one["aggregate_tps"][k]
                      for k in one["aggregate_tps"]}}
    return out


def markdown(result: dict) -> str:
    streams = [k for k in result["streams"] if k > 1]
    rows = []
    for preset, r in result["presets"].items():
        for variant, v in r["variants"].items():
            for name in ("one_rank", "two_ranks"):
                x = v[name]
                rows.append([preset, variant, x["ranks"],
                             report.num(x["single_stream_decode_tps"], ".1f"),
                             *(report.num(x["aggregate_tps"][str(k)], ".1f") for k in streams)])
            ratio = v["ratio_two_over_one"]
            rows.append([preset, variant, "**2 ÷ 1**",
                         f"**{report.num(ratio['single_stream_decode'], '.2f')}**",
                         *(f"**{report.num(ratio['aggregate'][str(k)], '.2f')}**"
                           for k in streams)])
    plan = [[preset, x["rank"], f"{x['layers'][0]}..{x['layers'][1] - 1}", x["weights_bytes"],
             x["comm_bytes"], x["kv_bytes_per_token"], x["per_sequence_fixed_bytes"],
             x["pool_blocks"], x["footprint_bytes"], f"{x['u']:.3f}"]
            for preset, r in result["presets"].items() for x in r["plan"]["ranks"]]
    load = result.get("loadavg")
    return "\n".join([
        f"# Clustered mode: one rank vs two ranks ({result['host']})", "",
        *([f"Command: `{result['command']}`", ""] if result.get("command") else []),
        (f"{result['when']}; {result['repeats']} repeats, {result['tokens']} tokens per "
         "stream, temperature 0, context 2048, concurrency the most streams; ring backend on "
         "127.0.0.1, every rank a process with its own figures. Stages: `loop` the per-layer "
         "loop (one slot per sequence, stepped one at a time); `engine` the worker's engine "
         "on every rank, one step at a time through the ranks (`--micro-batches 1`); "
         "`engine-pipelined` the same in two micro-batches (the default): alternate halves of "
         "the decodes, one on rank 0 while the other is on rank 1."), "",
        *report.table(["model", "stage", "ranks", "single-stream decode tok/s",
                       *(f"{k} streams aggregate tok/s" for k in streams)], rows),
        "", "## Per-rank admission (two ranks; `plimsoll cluster plan --json`)", "",
        *report.table(["model", "rank", "layers", "weights B", "comm B", "KV B/token",
                       "fixed B/seq", "pool blocks", "footprint B", "u"], plan),
        "", ("Each rank loads exactly its planned weights share (`loaded_bytes` in the "
             "JSON); with a tied head the last rank holds the embedding matrix again."),
        ("A tiny model is latency-bound: per step the split adds a header and an "
         "activation message per rank boundary and the tokens' message back to rank 0, "
         "each a wake-up of another process, and the ranks share the CPU cores with "
         "whatever else runs; on a box with fewer cores than ranks × threads, overlapping "
         "two ranks' compute gains little, since they take turns on the same cores.")
        + (f" Load average (1 min) at start/end: {load['start']:.1f}/{load['end']:.1f}."
           if load else "")]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "hybrid"], choices=sorted(SPLITS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=["engine-pipelined"],
                    choices=sorted(VARIANTS), help="stages to measure (demo presets)")
    ap.add_argument("--together", default="2",
                    help="demo presets: comma list of stream counts released together")
    ap.add_argument("--models", type=Path, default=report.OUT / "cluster-models")
    report.output_args(ap, "cluster")
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="only rewrite the markdown of an earlier run's JSON (beside it)")
    served = ap.add_argument_group("a built model (--model): one rank against two")
    served.add_argument("--model", type=Path, help="a built model directory: the served runs")
    served.add_argument("--phases", default="one,ring,nccl,too-big",
                        help="comma list of one, ring, nccl, too-big, run in that order")
    served.add_argument("--stage", choices=["engine", "loop"], default="engine")
    served.add_argument("--micro-batches", type=int, choices=[1, 2], default=2,
                        help="engine stage: steps in flight across the ranks")
    served.add_argument("--parallel", choices=["pipeline", "tensor"], default="pipeline",
                        help="split by layers, or every layer across the ranks (tensor)")
    served.add_argument("--rank-gib", type=float, default=24.0,
                        help="each rank's slice in the one/ring/nccl runs")
    served.add_argument("--too-big-gib", default="auto",
                        help="each rank's slice in the too-big runs (GiB, or auto)")
    served.add_argument("--streams", default="1,8,32")
    served.add_argument("--too-big-streams", default="1,8")
    served.add_argument("--concurrency", type=int, help="default: the most streams")
    served.add_argument("--context", type=int, default=2048)
    served.add_argument("--max-tokens", type=int, default=512)
    served.add_argument("--preload", default=OPENBLAS,
                        help="LD_PRELOAD for the ranks where the file exists ('' for none)")
    served.add_argument("--log-dir", type=Path, help="every rank's log, by run")
    served.add_argument("--deadline-s", type=float, default=480.0,
                        help="no run starts, and no round, past this many seconds")
    served.add_argument("--min-run-s", type=float, default=40.0,
                        help="a run starts only with this many seconds left")
    served.add_argument("--start-timeout", type=float, default=150.0)
    served.add_argument("--nccl-start-timeout", type=float, default=90.0,
                        help="the nccl run's (a group that will not form does not wait long)")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
        writer = served_markdown if "runs" in result else markdown
        args.render.with_suffix(".md").write_text(writer(result))
        return 0
    if args.model:
        return served_main(args)
    from plimsoll.demo.model import build_demo_model

    result = {"command": report.command(),
              "host": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "repeats": args.repeats, "tokens": args.tokens, "presets": {},
              "streams": [1, *(int(k) for k in args.together.split(",") if k)],
              "loadavg": {"start": os.getloadavg()[0]}}
    for preset in args.presets:
        model = args.models / preset
        if not (model / "config.json").exists():
            build_demo_model(model, preset=preset)
        print(f"{preset}: planning and measuring", file=sys.stderr, flush=True)
        result["presets"][preset] = {
            "plan": plan_figures(model, SPLITS[preset]),
            "variants": measure(preset, model, args.repeats, args.tokens, args.variants,
                                result["streams"])}
    result["loadavg"]["end"] = os.getloadavg()[0]
    report.write(result, args.out_dir, args.name or report.default_name("cluster"), markdown)
    print(markdown(result))
    return 0


def too_big_budget(model: Path, request, asked: str) -> dict:
    """The per-rank budget of the too-big runs, and the thresholds it sits between."""
    one = least_budget(model, 1, request, full=False)
    two = least_budget(model, 2, request, full=True)
    out = {"one_rank_least_bytes": one, "two_ranks_least_bytes": two,
           "concurrency": request.concurrency, "context": request.context}
    if asked != "auto":
        return out | {"budget_bytes": int(float(asked) * GIB), "how": "--too-big-gib"}
    if one is not None and two is not None and two >= one:
        # the request unclamped needs more per rank on two than one rank needs at all
        two = least_budget(model, 2, request, full=False) or two
        out |= {"two_ranks_least_bytes": two, "clamped": True}
    if one is None or two is None or two >= one:
        return out | {"budget_bytes": None, "how": (
            "auto: no per-rank budget that one rank refuses and two ranks commit (a model "
            "this small is outweighed by each rank's backend buffers): pass --too-big-gib")}
    return out | {"budget_bytes": (one + two) // 2,
                  "how": "auto: halfway between the two thresholds"}


def served_main(args) -> int:
    """The built model's runs (--model): one after another, the report rewritten after each."""
    from plimsoll.cluster.plan import ClusterRequest
    from plimsoll.core.model_facts import inspect_model

    # a SIGTERM (the script's timeout) closes the run in progress: every rank by pid
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    deadline = t0 + args.deadline_s
    streams = [int(x) for x in args.streams.split(",") if x]
    tb_streams = [int(x) for x in args.too_big_streams.split(",") if x]
    phases = [x for x in args.phases.split(",") if x]
    unknown = set(phases) - {"one", "ring", "nccl", "too-big"}
    if unknown:
        raise SystemExit(f"unknown phases {sorted(unknown)}")
    model = args.model.resolve()
    base = {"context": args.context, "max_tokens": args.max_tokens, "stage": args.stage,
            "micro_batches": args.micro_batches, "parallel": args.parallel}
    request = ClusterRequest(concurrency=args.concurrency or max(streams), **base)
    tb_request = ClusterRequest(concurrency=max(tb_streams), **base)
    facts = inspect_model(model)
    name = args.name or report.default_name("cluster")
    log_dir = args.log_dir or args.out_dir / "logs" / name
    env = server_env(args.preload)
    gpu = Gpu()
    host = report.host_facts()
    result = {"command": report.command(), "host": host, "model": str(model),
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "model_facts": {"weights_bytes": facts.weights_bytes, "layers": facts.num_layers,
                              "kv_bytes_per_token": facts.kv_bytes_per_token},
              "stage": args.stage, "request": request.model_dump(), "streams": streams,
              "tokens": args.tokens, "repeats": args.repeats,
              "rank_bytes": int(args.rank_gib * GIB), "phases": phases, "runs": {}}

    def say(line: str) -> None:
        print(f"[cluster +{time.monotonic() - t0:5.0f}s] {line}", flush=True)

    def save() -> None:
        host["loadavg_end"] = report.loadavg()
        report.write(result, args.out_dir, name, served_markdown)

    def run(key: str, budgets: list[int], req, counts: list[int], extra_env=None) -> None:
        left = deadline - time.monotonic()
        if left < args.min_run_s:
            say(f"{key}: skipped, {left:.0f} s left")
            result["runs"][key] = {"ranks": len(budgets), "backend": req.backend,
                                   "budget_bytes": budgets, "plan": pure_plan(model, budgets, req),
                                   "error": f"not run: {left:.0f} s left of the deadline"}
            return
        say(f"{key}: {len(budgets)} rank(s) of {budgets[0] / GIB:.2f} GiB"
            + (f" over {req.backend}" if len(budgets) > 1 else "") + f", stage {req.stage}")
        req = req.model_copy(update={"stage": result["stage"]})
        got = serve_run(model, budgets, req, env=env | (extra_env or {}), workdir=log_dir / key,
                        streams=counts, tokens=args.tokens, repeats=args.repeats,
                        deadline=deadline, gpu=gpu, say=say,
                        start_timeout=args.nccl_start_timeout if req.backend == "nccl"
                        and len(budgets) > 1 else args.start_timeout)
        if (got.get("error") and req.stage == "engine" and req.backend != "nccl"
                and not result["runs"]):
            # the first run failed on the engine stage: every run goes on the per-layer loop
            result["stage"], result["stage_fallback"] = "loop", got["error"]
            result["runs"][f"{key}-engine"] = got
            save()
            say(f"{key}: the engine stage failed; again, and every later run, on the loop")
            return run(key, budgets, req, counts, extra_env)
        result["runs"][key] = got
        save()

    rank = int(args.rank_gib * GIB)
    for phase in phases:
        if phase == "one":
            run("one", [rank], request, streams)
        elif phase in ("ring", "nccl"):
            req = request.model_copy(update={"backend": phase})
            run(phase, [rank, rank], req, streams,
                {"NCCL_DEBUG": "WARN"} if phase == "nccl" else None)
        else:
            tb = too_big_budget(model, tb_request, args.too_big_gib)
            result["too_big"] = tb
            if (b := tb["budget_bytes"]) is None:
                say(f"too-big: not run: {tb['how']}")
                continue
            run("too-big-one", [b], tb_request, tb_streams)
            run("too-big-two", [b, b], tb_request, tb_streams)
    save()
    print(served_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
