"""bench/cluster.py's served-model runs: one built model on one rank and on two, by backend.

Every run is a :class:`plimsoll.cluster.runner.Cluster` of this machine's ranks on 127.0.0.1
(rank 0 serving the worker API), each rank with its own figures on its command line (ceiling
= total = budget = its slice: nothing is probed, so two ranks sharing one GPU each admit
against their own slice, not the whole device or the host's RAM), measured, then closed
before the next starts:

- :func:`pure_plan`: the same pure plan and two-phase decision the ranks make;
- :func:`least_budget`: the smallest per-rank budget at which ``n`` equal ranks commit (a
  bisection on the pure plan; admission is monotone in the budget);
- :func:`serve_run`: start, read every rank's admitted figures from rank 0's status, warm
  up every stream count, then ``repeats`` rounds of N streams released together per count,
  sampling each rank's memory (its GPU memory per ``nvidia-smi``, its RSS, the GPU's used
  memory less its reading before the start); a refusal or a failure is the run's figure
  (every rank's reasons and its log's tail).

Nothing here imports mlx; every wait is bounded by the caller's deadline.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

import httpx

from lib.samplers import Gpu, Sampler, tree_rss
from lib.status import figures as status_figures
from lib.workloads import concurrent_streams, timed_stream, word_prompt

GIB = 1 << 30
#: words per prompt: every stream its own prompt (no shared prefix to hit)
PROMPT_WORDS = 24


def pure_plan(model: Path, budgets: list[int], request) -> dict:
    """Every rank's plan and admission answer, and the decision, as the ranks compute them."""
    from plimsoll.cluster import plan as cluster_plan
    from plimsoll.cluster.weights import read_config, tensor_bytes
    from plimsoll.core.model_facts import inspect_model

    facts = inspect_model(model)
    probes = [cluster_plan.RankProbe(rank=r, ceiling_bytes=b, total_ram_bytes=b, budget_bytes=b,
                                     source="bench") for r, b in enumerate(budgets)]
    plans = cluster_plan.plan_cluster(read_config(model), facts, tensor_bytes(model), probes,
                                      request)
    answers = [cluster_plan.preflight(p, pr, facts, request).model_copy(update={"reserved": True})
               for p, pr in zip(plans, probes, strict=True)]
    answers = [a if a.admitted else a.model_copy(update={"reserved": False}) for a in answers]
    decision = cluster_plan.decide(answers, len(budgets))
    ranks = []
    for a in answers:
        p, d = a.plan, a.decision
        ranks.append({"rank": a.rank, "layers": [p.layer_start, p.layer_end],
                      "weights_bytes": p.weights_bytes, "comm_bytes": p.comm_bytes,
                      "transport_bytes": p.transport_bytes,
                      "kv_bytes_per_token": p.kv_bytes_per_token,
                      "admitted": a.admitted, "decision": d.decision,
                      "concurrency": d.concurrency, "context": d.context,
                      "pool_blocks": d.pool_blocks, "footprint_bytes": d.footprint_bytes,
                      "allocation_limit_bytes": d.allocation_limit_bytes,
                      "budget_bytes": d.budget_bytes, "reasons": a.reasons})
    return {"ranks": ranks, "action": decision.action, "concurrency": decision.concurrency,
            "context": decision.context, "explain": decision.explain(),
            "weights_bytes": facts.weights_bytes, "kv_bytes_per_token": facts.kv_bytes_per_token}


def least_budget(model: Path, n: int, request, *, full: bool, hi: int = 1 << 42) -> int | None:
    """The smallest per-rank budget (bytes, to 1 MiB) at which ``n`` equal ranks commit;
    ``full``: with the request's concurrency and context unclamped. None: not even at ``hi``."""
    def ok(b: int) -> bool:
        got = pure_plan(model, [b] * n, request)
        return got["action"] == "commit" and (not full or (
            got["concurrency"] >= request.concurrency and got["context"] >= request.context))

    lo, step = 1 << 20, 1 << 20
    if not ok(hi):
        return None
    while hi - lo > step:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def _rank_sampler(pids: list[int], gpu: Gpu | None, baseline: int | None,
                  interval: float) -> Sampler:
    """Each rank's RSS and (where nvidia-smi lists it) GPU memory; the GPU's used memory
    less its reading before the cluster started (the ranks together)."""
    def probe() -> dict[str, float | None]:
        per_pid = gpu.by_pid() if gpu is not None and gpu.present else {}
        out: dict[str, float | None] = {}
        for r, pid in enumerate(pids):
            out[f"rank{r}_rss"] = tree_rss(pid)[0] or None
            out[f"rank{r}_gpu_proc"] = per_pid.get(pid)
        if gpu is not None and gpu.present:
            used = gpu.total_used()
            out["gpu_used"] = None if used is None or baseline is None else used - baseline
        return out

    return Sampler(probe, interval)


def _bodies(n: int, tokens: int, ignore_eos: bool, salt: int) -> list[dict]:
    return [{"prompt": word_prompt(salt * 1000 + i, PROMPT_WORDS), "max_tokens": tokens,
             "temperature": 0, **({"ignore_eos": True} if ignore_eos else {})}
            for i in range(n)]


def _streams(url: str, n: int, tokens: int, ignore_eos: bool, salt: int,
             timeout_s: float) -> dict:
    r = concurrent_streams(url, _bodies(n, tokens, ignore_eos, salt), timeout_s,
                           path="/v1/completions")
    keep = ("streams", "completed", "errors", "completion_tokens", "wall_s", "aggregate_tps",
            "aggregate_tps_after_first_token", "step_ms", "ttft_s", "ttft_max_s",
            "per_stream_decode_tps", "finish_reasons")
    out = {k: r.get(k) for k in keep}
    if r.get("ttft_s"):
        out["ttft_median_s"] = statistics.median(r["ttft_s"])
    return out


def _medians(runs: list[dict]) -> dict:
    def med(key: str):
        xs = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    decode = [x for r in runs for x in (r.get("per_stream_decode_tps") or []) if x]
    return {"aggregate_tps": med("aggregate_tps"), "step_ms": med("step_ms"),
            "aggregate_tps_after_first_token": med("aggregate_tps_after_first_token"),
            "ttft_median_s": med("ttft_median_s"), "ttft_max_s": med("ttft_max_s"),
            "per_stream_decode_tps": statistics.median(decode) if decode else None,
            "completed": sum(r.get("completed") or 0 for r in runs),
            "streams": sum(r.get("streams") or 0 for r in runs)}


def _log_tails(workdir: Path, ranks: int, lines: int = 15) -> dict[int, str]:
    out = {}
    for r in range(ranks):
        path = workdir / f"rank{r}.log"
        with contextlib.suppress(OSError):
            out[r] = "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return out


def serve_run(model: Path, budgets: list[int], request, *, env: dict[str, str], workdir: Path,
              streams: list[int], tokens: int, repeats: int, deadline: float,
              start_timeout: float = 150.0, request_timeout: float = 120.0,
              gpu: Gpu | None = None, interval: float = 0.2, say=print) -> dict:
    """Serve ``model`` on ``len(budgets)`` ranks over ``request.backend``, measure, close."""
    from plimsoll.cluster.exits import ClusterError, ClusterRefused
    from plimsoll.cluster.runner import Cluster, RankSpec, ServeSpec
    from plimsoll.web.serve import free_port

    out: dict = {"ranks": len(budgets), "backend": request.backend if len(budgets) > 1 else None,
                 "stage": request.stage, "budget_bytes": budgets,
                 "plan": pure_plan(model, budgets, request), "error": None, "refused": None}
    workdir.mkdir(parents=True, exist_ok=True)
    specs = [RankSpec(ceiling_bytes=b, total_ram_bytes=b, budget_bytes=b) for b in budgets]
    cluster = Cluster(model, specs, request, env=env, workdir=workdir,
                      serve=ServeSpec(port=free_port(), model_name=model.name))
    baseline = gpu.total_used() if gpu is not None and gpu.present else None
    sampler = None
    t0 = time.monotonic()
    try:
        left = deadline - time.monotonic()
        cluster.start(timeout=max(10.0, min(start_timeout, left - 10)))
        out["start_s"] = time.monotonic() - t0
        url = cluster.serving["url"]
        say(f"  up in {out['start_s']:.1f} s at {url} (pids {cluster.pids})")
        out["ready"] = [cluster.ready[r] for r in sorted(cluster.ready)]
        with contextlib.suppress(httpx.HTTPError, ValueError):
            status = httpx.get(url + "/v1/plimsoll/status", timeout=10).json()
            out["status_ranks"] = (status.get("cluster") or {}).get("ranks")
            out["status_decision"] = (status.get("cluster") or {}).get("decision")
        sampler = _rank_sampler(cluster.pids, gpu, baseline, interval).start()
        warm = timed_stream(url, _bodies(1, 2, True, 0)[0], 60, path="/v1/completions")
        ignore_eos = warm.get("status_code") not in (400, 422)  # else: sent without it
        out["ignore_eos"], out["first_request_error"] = ignore_eos, warm.get("error")
        for n in streams:  # first-use costs (kernels per batch shape) out of the figures
            if deadline - time.monotonic() < 20:
                break
            _streams(url, n, 4, ignore_eos, 1, min(request_timeout, deadline - time.monotonic()))
        out["warmup_s"] = time.monotonic() - t0 - out["start_s"]
        runs: dict[str, list[dict]] = {str(n): [] for n in streams}
        peaks: dict[str, dict] = {}
        for rep in range(repeats):
            for n in streams:
                left = deadline - time.monotonic()
                if left < 15:
                    out["cut_short"] = f"deadline: round {rep + 1}, {n} streams not run"
                    break
                sampler.mark()
                got = _streams(url, n, tokens, ignore_eos, 2 + rep, min(request_timeout, left - 5))
                runs[str(n)].append(got)
                window = sampler.window_peaks()
                peaks[str(n)] = {k: max(v, peaks.get(str(n), {}).get(k, 0))
                                 for k, v in window.items()}
                say(f"  {n} streams, round {rep + 1}: {got.get('aggregate_tps') or 0:.1f} tok/s "
                    f"aggregate, TTFT median {got.get('ttft_median_s') or 0:.3f} s, "
                    f"{got.get('completed')}/{n} completed")
            if "cut_short" in out:
                break
        out["streams"] = {n: {"median": _medians(r), "runs": r} for n, r in runs.items() if r}
        with contextlib.suppress(httpx.HTTPError, ValueError):
            after = httpx.get(url + "/v1/plimsoll/status", timeout=10).json()
            out["rank0_status_after"] = status_figures(after)
        out["memory"] = {"by_streams": peaks, "overall": sampler.overall_peaks(),
                         "gpu_source": None if gpu is None or not gpu.present else gpu.source,
                         "gpu_baseline_bytes": baseline}
    except ClusterRefused as err:
        out["refused"] = err.decision.explain()
        say(f"  refused: {err.decision.explain().splitlines()[0]}")
    except ClusterError as err:
        out["error"] = str(err)
        out["rank_logs"] = _log_tails(workdir, len(budgets))
        say(f"  failed: {str(err).splitlines()[0]}")
    except Exception as err:  # a run that breaks is recorded; the next run still goes
        out["error"] = f"{type(err).__name__}: {err}"
        out["rank_logs"] = _log_tails(workdir, len(budgets))
        say(f"  failed: {out['error'].splitlines()[0]}")
    finally:
        if sampler is not None:
            sampler.stop()
        cluster.close()
        out["total_s"] = time.monotonic() - t0
    return out


# ---------------------------------------------------------------- the report


def _gib(x) -> str:
    return "–" if x is None else f"{x / GIB:.2f}"


def _ms(x) -> str:
    return "–" if x is None else f"{1000 * x:.0f}"


def _num(x, fmt: str = ".1f") -> str:
    return "–" if x is None else format(x, fmt)


def _label(run: dict) -> str:
    if run["ranks"] == 1:
        return "1 rank"
    return f"{run['ranks']} ranks, {run['backend']}"


def _outcome(run: dict) -> str:
    if run.get("refused"):
        return "refused: " + run["refused"].splitlines()[0]
    if run.get("error"):
        return "failed: " + run["error"].splitlines()[0]
    return "served"


def markdown(result: dict) -> str:
    """The served-model report: tok/s and TTFT by stream count, one rank against two, each
    rank's memory against its admitted footprint, the model too big for one rank."""
    from lib import report

    runs: dict[str, dict] = result["runs"]
    one = runs.get("one") or {}
    rows = []
    for name, run in runs.items():
        for n, s in (run.get("streams") or {}).items():
            m = s["median"]
            base = ((one.get("streams") or {}).get(n) or {}).get("median", {})
            ratio = (m["aggregate_tps"] / base["aggregate_tps"]
                     if m.get("aggregate_tps") and base.get("aggregate_tps") else None)
            rows.append([name, _label(run), n, _num(m["aggregate_tps"]),
                         _num(m["per_stream_decode_tps"]), _num(m["step_ms"]),
                         _ms(m["ttft_median_s"]), _ms(m["ttft_max_s"]),
                         f"{m['completed']}/{m['streams']}",
                         "1.00" if name == "one" else _num(ratio, ".2f")])
    mem = []
    for name, run in runs.items():
        figures = run.get("status_ranks") or run["plan"]["ranks"]
        overall = (run.get("memory") or {}).get("overall", {})
        for x in figures:
            r = x["rank"]
            gpu, rss = overall.get(f"rank{r}_gpu_proc"), overall.get(f"rank{r}_rss")
            peak = gpu or rss
            mem.append([name, r, f"{x['layers'][0]}..{x['layers'][1] - 1}",
                        _gib(x["weights_bytes"]), _gib(x.get("transport_bytes")),
                        _gib(x["footprint_bytes"]), _gib(x.get("allocation_limit_bytes")),
                        _gib(x.get("memory_limit_applied_bytes")),
                        _gib(x.get("active_memory_at_load_bytes")), _gib(gpu), _gib(rss),
                        _num(peak / x["footprint_bytes"], ".2f")
                        if peak and x.get("footprint_bytes") else "–"])
    outcomes = [[name, _label(run), run.get("stage", "–"), _gib(run["budget_bytes"][0]),
                 run["plan"]["action"], _outcome(run), _num(run.get("start_s"))]
                for name, run in runs.items()]
    tb = result.get("too_big") or {}
    machine = result["host"].get("gpu") or result["host"].get("platform")
    lines = [f"# Clustered mode on one machine: one rank against two ({machine})",
             "", f"Command: `{result['command']}`", "", report.host_line(result["host"]), "",
             (f"{result['when']}. Model `{result['model']}`: weights "
              f"{_gib(result['model_facts']['weights_bytes'])} GiB, KV "
              f"{result['model_facts']['kv_bytes_per_token']} B/token. Stage `{result['stage']}`"
              f"; every rank a process on this machine (two ranks share its one device), "
              f"admitted on its own figures (ceiling = total = budget = its slice, on its "
              f"command line: nothing probed), its MLX memory limit set to its admitted "
              f"allocation limit. Request: concurrency {result['request']['concurrency']}, "
              f"context {result['request']['context']}, max tokens "
              f"{result['request']['max_tokens']}; {result['tokens']} tokens per stream "
              f"(ignore_eos where taken), temperature 0, streams released together, "
              f"{result['repeats']} round(s), medians; a warm-up at every stream count "
              "first."), "",
             "## Each run", "",
             *report.table(["run", "ranks", "stage", "budget per rank GiB", "pure plan",
                            "outcome", "start s"], outcomes),
             "", "## Throughput and TTFT", "",
             ("Aggregate tok/s = all completion tokens ÷ first send to last end (prefill "
              "included); per-stream decode = (tokens − 1) ÷ (last − first token), median over "
              "streams; step = the median stream's time between tokens; × 1 rank = aggregate "
              "÷ the one-rank run's at the same stream count."), "",
             *report.table(["run", "ranks", "streams", "aggregate tok/s",
                            "per-stream decode tok/s", "step ms", "TTFT median ms",
                            "TTFT max ms", "completed", "× 1 rank"], rows),
             "", "## Per-rank memory against its admitted footprint", "",
             ("Figures from rank 0's `/v1/plimsoll/status` (`.cluster.ranks`: the ranks' own "
              "plan and admission); peaks sampled during the measured rounds: GPU memory of the "
              "rank's process (nvidia-smi, CUDA context included), RSS of the rank's process. "
              "peak ÷ footprint uses the GPU figure where there is one, else RSS."), "",
             *report.table(["run", "rank", "layers", "weights GiB", "backend buffers GiB",
                            "footprint GiB", "allocation limit GiB", "MLX limit applied GiB",
                            "MLX active at load GiB", "peak GPU GiB", "peak RSS GiB",
                            "peak ÷ footprint"], mem)]
    gpu_lines = []
    for name, run in runs.items():
        overall = (run.get("memory") or {}).get("overall", {})
        if overall.get("gpu_used") is not None:
            total = sum(x["footprint_bytes"] for x in run.get("status_ranks") or [])
            gpu_lines.append(f"- {name}: the GPU's used memory rose by at most "
                             f"{_gib(overall['gpu_used'])} GiB (all ranks together; their "
                             f"footprints sum to {_gib(total)} GiB).")
        after = run.get("rank0_status_after") or {}
        if after.get("mlx_peak") is not None:
            gpu_lines.append(f"- {name}: rank 0's MLX peak (its status, after the rounds) "
                             f"{_gib(after['mlx_peak'])} GiB, its allocation limit "
                             f"{_gib(after.get('allocation_limit'))} GiB.")
    if gpu_lines:
        lines += ["", *gpu_lines]
    if result.get("stage_fallback"):
        lines += ["", "The engine stage failed on the first run (below, its `-engine` run); "
                  "every run then went on the per-layer loop (`--stage loop`)."]
    if tb:
        lines += ["", "## The model too big for one rank", "",
                  (f"Budget per rank {_gib(tb.get('budget_bytes'))} GiB ({tb['how']}): one rank "
                   f"commits from {_gib(tb.get('one_rank_least_bytes'))} GiB, two ranks (at "
                   f"concurrency {tb['concurrency']}, context {tb['context']} unclamped) from "
                   f"{_gib(tb.get('two_ranks_least_bytes'))} GiB."), ""]
        alone, two = runs.get("too-big-one"), runs.get("too-big-two")
        said = (alone.get("refused") or _outcome(alone)) if alone else "(not run)"
        lines += ["One rank at that budget (its runtime answer):", "", "```", said, "```", "",
                  f"Two ranks at that budget: {_outcome(two)}." if two else
                  "Two ranks: not run."]
    errors = [f"- {name}, {n} streams: {m['completed']}/{m['streams']} completed; first "
              f"error: {next(iter(e for r in s['runs'] for e in r.get('errors') or []), '–')}"
              for name, run in runs.items() for n, s in (run.get("streams") or {}).items()
              if (m := s["median"])["completed"] < m["streams"]]
    if errors:
        lines += ["", "## Streams that did not complete", "", *errors]
    for name, run in runs.items():
        if not run.get("error"):
            continue
        lines += ["", f"## {name}: what stopped it", "", "```", run["error"], "```"]
        for rank, tail in (run.get("rank_logs") or {}).items():
            lines += ["", f"rank {rank}'s log (last lines):", "", "```", tail or "(empty)",
                      "```"]
    return "\n".join(lines) + "\n"
