"""``plimsoll verify``: the cap-comprehensiveness run (docs/DESIGN.md, "The invariants").

A real worker runs in its own memory cgroup whose hard limit stands in for the wired
ceiling; each fault kind (:mod:`.faults`) is injected in turn, the last one
several at once, while a sampler (:mod:`.probe`, one probe per OS) records
RSS, MLX active memory, the cgroup's usage, fail count and OOM kills, host page-outs and
memory pressure. Pass = zero OOM kills, zero page-outs, the worker alive at the end, and
every phase controlled (each overload answered 503/429, or 400 naming the limit, instead
of growth past the line). The same run then drives ``mlx_lm.server`` under the same limit
and workload (:mod:`.contrast`), so the report shows both side by side.

Fault kinds: ``first_inference`` (full concurrency × full context on a fresh worker),
``long_prefill`` (one prompt at the context, one past it), ``overload`` (more requests
than slots + queue), ``mlx_spike`` / ``numpy_spike`` (an unplanned allocation between the
soft and the hard line), ``mmap_prefetch`` (a file larger than the limit mapped and read
through: reclaimable page cache), ``load_spike`` (the model loaded again beside the
serving one), ``together`` (a numpy spike + a prefetch + overload + a long prefill).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from plimsoll.core.progress import Reporter
from plimsoll.core.units import MIB

from .faults import FAULT_KINDS, PHASES, Phase, measured
from .probe import Sample, Sampler, probe_for
from .target import Prompts, Target, Workload, filesystem_of, make_scratch

__all__ = ["FAULT_KINDS", "Sample", "Sampler", "run_verify", "summary", "write_report"]

#: How long a queued request may wait: long enough that the first-inference fault really
#: runs ``concurrency`` full-context prefills (one after another on a busy CPU), short
#: enough that a stuck phase ends.
MAX_WAIT_S = 180.0
#: The contrast replays these (the spikes reuse plimsoll's sizes, so they run after it).
MMAP_KINDS = ("mmap_prefetch", "together")


def _swap_configured() -> bool:
    try:
        return len(Path("/proc/swaps").read_text().splitlines()) > 1
    except OSError:
        return False


def _mlx_active(url: str):
    def read() -> int | None:
        import httpx

        return httpx.get(f"{url}/v1/plimsoll/status", timeout=2).json()["mlx"]["active_bytes"]
    return read


def run_verify(model_dir: Path, *, limit_bytes: int = 1024 * MIB, concurrency: int = 4,
               context: int = 2048, max_tokens: int = 16, kinds: tuple[str, ...] = FAULT_KINDS,
               report: Reporter = lambda _m: None, env: dict[str, str] | None = None,
               contrast: bool | None = None, mmap_bytes: int | None = None,
               scratch_dir: Path | None = None, log_dir: Path | None = None) -> dict:
    """Start a guarded worker, inject each fault kind, then (``contrast``, default: when
    mlx_lm and a cgroup are available) replay it on mlx_lm.server; return the report."""
    from plimsoll.guard.process import RUNTIME_RESERVE_BYTES
    from plimsoll.launch import live_admission
    from plimsoll.launch.spawn import start_worker, stop_worker, worker_config
    from plimsoll.web.serve import free_port

    from .contrast import run_contrast, unavailable_reason

    unknown = [k for k in kinds if k not in PHASES]
    if unknown:
        raise ValueError(f"unknown fault kind(s) {unknown}: choose from {list(FAULT_KINDS)}")
    model_dir = Path(model_dir)
    budget = limit_bytes - RUNTIME_RESERVE_BYTES
    if budget <= 0:
        raise ValueError(f"--limit-mib must exceed the {RUNTIME_RESERVE_BYTES // MIB} MiB "
                         "runtime reserve")
    figures = live_admission.MemoryFigures(limit_bytes, limit_bytes, budget,
                                           "verify: the cgroup limit is the ceiling")
    wanted = live_admission.Wanted(concurrency=concurrency, context=context,
                                   max_tokens=max_tokens)
    facts, _, decision = live_admission.plan(model_dir, None, None, figures, wanted)
    if not decision.admitted:
        raise RuntimeError("admission refused the model under this limit: "
                           + "; ".join(decision.reasons))
    cfg = worker_config(model_dir, model_dir.name, facts, decision, None, None,
                        port=free_port(), max_queue=4, max_wait_s=MAX_WAIT_S)
    contrast_why = unavailable_reason()
    if contrast is None:
        contrast = contrast_why is None
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = Prompts(model_dir, vocab)
    work = Workload(model_dir, cfg.max_num_seqs, cfg.context, cfg.max_tokens,
                    cfg.default_max_tokens, cfg.max_queue)
    scratch = None
    if any(k in kinds for k in MMAP_KINDS):
        where = scratch_dir or Path(tempfile.gettempdir())
        if filesystem_of(where) in ("tmpfs", "ramfs"):
            raise ValueError(f"{where} is on {filesystem_of(where)}: its pages are not "
                             "reclaimable page cache, so the prefetch fault would prove "
                             "nothing; pass --scratch-dir on a disk")
        scratch = Path(tempfile.mkdtemp(prefix="plimsoll-verify-", dir=scratch_dir))
        size = mmap_bytes or (limit_bytes * 3) // 2
        report(f"writing a {size // MIB} MiB scratch file for the prefetch fault in {scratch}")
        work.mmap_path = make_scratch(scratch, size)
    try:
        result = _run_plimsoll(cfg, limit_bytes, work, prompts, kinds, report, env,
                               start_worker, stop_worker)
        if contrast and contrast_why is None:
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
            try:  # the contrast failing must not lose plimsoll's own figures
                result["contrast"] = run_contrast(
                    work, prompts, limit_bytes, kinds, env=env, report=report,
                    log_path=(log_dir / "mlx_lm-server.log") if log_dir else None)
            except (OSError, RuntimeError, ValueError) as err:
                result["contrast"] = {"ran": False, "reason": f"the contrast run failed: "
                                      f"{type(err).__name__}: {err}"}
        else:
            result["contrast"] = {"ran": False,
                                  "reason": contrast_why or "turned off (--no-contrast)"}
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    result["workload"] = {"model_dir": str(model_dir), "concurrency": work.concurrency,
                          "context": work.context, "max_tokens": work.max_tokens,
                          "default_max_tokens": work.default_max_tokens,
                          "max_queue": work.max_queue, "kinds": list(kinds),
                          "mmap_file_bytes": (mmap_bytes or (limit_bytes * 3) // 2)
                          if scratch else None,
                          "spike_mib": work.spike_mib, "load_copies": work.load_copies}
    result["not_run"] = [k for k in FAULT_KINDS if k not in kinds]
    return result


def _run_plimsoll(cfg, limit_bytes: int, work: Workload, prompts: Prompts,
                  kinds: tuple[str, ...], report: Reporter, env, start_worker,
                  stop_worker) -> dict:
    report(f"starting the worker under a {limit_bytes // MIB} MiB cgroup limit")
    t_start = time.monotonic()
    proc, _status = start_worker(cfg, cgroup_limit_bytes=limit_bytes, env=env)
    guard = proc.plimsoll_guard
    url = f"http://{cfg.host}:{cfg.port}"
    sampler = Sampler(probe_for(proc.pid, guard.cgroup if guard else None),
                      mlx_active=_mlx_active(url))
    sampler.start()
    target = Target("plimsoll", url, cfg.model_name, proc, guard.cgroup if guard else None,
                    prompts, guarded=guard is not None)
    phases: list[Phase] = []
    final: dict = {}
    try:
        for kind in kinds:
            report(f"fault: {kind}")
            ph = measured(kind, target, work, env, sampler, settle_s=0.3)
            phases.append(ph)
            report(f"{kind}: {'pass' if ph.passed else 'FAIL'} {ph.answers}")
            if not ph.target_alive:
                report(f"the worker exited ({proc.returncode}); stopping")
                break
        if proc.poll() is None:
            import httpx

            final = httpx.get(f"{url}/v1/plimsoll/status", timeout=10).json()
    finally:
        alive = proc.poll() is None
        whole = sampler.window(t_start, time.monotonic())
        whole["peak_usage_bytes"] = max([whole["peak_usage_bytes"]]
                                        + [p.figures["peak_usage_bytes"] for p in phases])
        stop_worker(proc)
        sampler.stop()
    oom, pageouts = whole["oom_kill_delta"], whole["pswpout_delta"]
    passed = alive and oom == 0 and pageouts == 0 and all(p.passed for p in phases)
    return {
        "passed": passed, "platform": sys.platform,
        "pressure_figure": sampler.probe.pressure_name,
        "guard": ({"cgroup": str(guard.cgroup.path), "limit_bytes": limit_bytes}
                  if guard else None),
        "worker": {"model_dir": str(cfg.model_dir), "concurrency": cfg.max_num_seqs,
                   "context": cfg.context, "max_queue": cfg.max_queue,
                   "pool_blocks": cfg.max_cache_blocks, "alive_at_end": alive,
                   "soft_bytes": (final.get("cgroup") or {}).get("soft_bytes"),
                   "mlx_peak_bytes": (final.get("mlx") or {}).get("peak_bytes")},
        "totals": {**whole, "oom_kills": oom, "page_outs": pageouts,
                   "swap_configured": _swap_configured()},
        "phases": [asdict(p) for p in phases],
    }


# --- the readable half ------------------------------------------------------------------------
def _mb(b) -> str:
    return "n/a" if b is None else f"{b / MIB:.0f}"


def _answers(a: dict) -> str:
    return ", ".join(f"{k}×{v}" for k, v in sorted(a.items())) or "—"


def summary(result: dict) -> str:
    """A Markdown summary: totals, then one row per fault kind, plimsoll beside mlx_lm.server."""
    t, g, w = result["totals"], result["guard"] or {}, result["worker"]
    c = result.get("contrast") or {"ran": False, "reason": "not asked"}
    lines = [f"# plimsoll verify: {'PASS' if result['passed'] else 'FAIL'}", "",
             f"- limit (cgroup hard line): {_mb(g.get('limit_bytes'))} MiB; soft line "
             f"{_mb(w['soft_bytes'])} MiB; cgroup {g.get('cgroup', 'none')}",
             f"- worker: concurrency {w['concurrency']}, context {w['context']}, queue "
             f"{w['max_queue']}, pool {w['pool_blocks']} blocks; alive at end: "
             f"{w['alive_at_end']}",
             f"- plimsoll totals: OOM kills {t['oom_kills']}, page-outs (pswpout) "
             f"{t['page_outs']} (swap configured: {t['swap_configured']}), cgroup failcnt "
             f"{t['failcnt_delta']}, peak usage {_mb(t['peak_usage_bytes'])} MiB, peak RSS "
             f"{_mb(t['peak_rss_bytes'])} MiB, MLX active peak "
             f"{_mb(t['mlx_active_peak_bytes'])} MiB, {result.get('pressure_figure', 'PSI')} "
             f"max {t['pressure_max']}"]
    if c.get("ran"):
        lines.append(f"- mlx_lm.server (same limit {_mb(c['limit_bytes'])} MiB, own cgroup): "
                     f"OOM kills {c['oom_kills']}, cgroup failcnt {c['failcnt']}, started "
                     f"{c['starts']} time(s) (restarted after each death)")
    else:
        lines.append(f"- mlx_lm.server contrast not run: {c.get('reason')}")
    other = {p["kind"]: p for p in c.get("phases", []) if "outcome" in p}
    lines += ["", "Usage counts page cache (the prefetch leaves the cgroup full of it, "
              "reclaimable); the working set (usage less inactive file pages) is what the soft "
              "line watches.",
              "", "| fault | plimsoll | peak usage MiB | peak working set MiB | peak RSS MiB "
              "| MLX active MiB | answers | OOM | failcnt | pswpout | pressure max "
              "| mlx_lm.server | its peak usage / working set MiB | its answers |",
              "|" + "---|" * 14]
    for p in result["phases"]:
        f, o = p["figures"], other.get(p["kind"])
        of = o["figures"] if o else {}
        lines.append(
            f"| {p['kind']} | {'pass' if p['passed'] else 'FAIL'} "
            f"| {_mb(f.get('peak_usage_bytes'))} | {_mb(f.get('peak_working_set_bytes'))} "
            f"| {_mb(f.get('peak_rss_bytes'))} | {_mb(f.get('mlx_active_peak_bytes'))} "
            f"| {_answers(p['answers'])} | {f.get('oom_kill_delta')} "
            f"| {f.get('failcnt_delta')} | {f.get('pswpout_delta')} | {f.get('pressure_max')} "
            f"| {o['outcome'] if o else 'not run'} "
            f"| {_mb(of.get('peak_usage_bytes')) if o else ''}"
            f"{' / ' + _mb(of.get('peak_working_set_bytes')) if o else ''} "
            f"| {_answers(o['answers']) if o else ''} |")
    lines += ["", "## Notes", ""]
    for p in result["phases"]:
        for note in p["notes"]:
            lines.append(f"- plimsoll {p['kind']} ({p['seconds']} s): {note}")
    for p in c.get("phases", []):
        for note in p.get("notes", []):
            lines.append(f"- mlx_lm.server {p['kind']} ({p.get('seconds')} s): {note}")
        if "error" in p:
            lines.append(f"- mlx_lm.server: {p['error']}")
    if result.get("not_run"):
        lines.append(f"- not run: {', '.join(result['not_run'])}")
    return "\n".join(lines)


def write_report(result: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    js, md = out_dir / f"verify-{stamp}.json", out_dir / f"verify-{stamp}.md"
    js.write_text(json.dumps(result, indent=2) + "\n")
    md.write_text(summary(result) + "\n")
    return js, md
