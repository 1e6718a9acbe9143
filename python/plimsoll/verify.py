"""``plimsoll verify``: the cap-comprehensiveness run (DESIGN.md invariant 7), Linux part.

A real worker runs in its own memory cgroup whose hard limit stands in for the wired
ceiling; faults are injected one kind at a time while a sampler thread records the
worker's RSS, the cgroup's usage, fail count and OOM kills, host page-outs
(``pswpout``) and PSI. Pass = zero OOM kills, zero page-outs, the worker alive, and
every overload answered with a controlled 503/429 (or a 400 that names the limit)
instead of growth past the line.

Fault kinds:

- ``mlx_spike`` / ``numpy_spike``: an allocation the scheduler did not plan, made by a
  helper (:mod:`plimsoll.engine.spike`) placed in the worker's cgroup, sized to cross the
  guard's soft line but not the hard one; requests sent meanwhile must get 503
  ``memory_trip``; after release the worker must serve again.
- ``first_inference``: ``concurrency`` simultaneous prompts that fill the context, on a
  freshly loaded worker.
- ``long_prefill``: one prompt at the full context, and one over it (400).
- ``overload``: more requests than slots plus queue (503 ``queue_full``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .progress import Reporter
from .units import MIB

FAULT_KINDS = ("first_inference", "long_prefill", "overload", "mlx_spike", "numpy_spike")


# --- sampling -----------------------------------------------------------------------------
def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def pswpout() -> int:
    for line in _read("/proc/vmstat").splitlines():
        if line.startswith("pswpout "):
            return int(line.split()[1])
    return 0


def psi_some_avg10() -> float | None:
    for line in _read("/proc/pressure/memory").splitlines():
        if line.startswith("some "):
            return float(line.split()[1].split("=")[1])
    return None


@dataclass
class Sample:
    t: float
    rss: int
    usage: int
    working_set: int
    failcnt: int
    oom_kill: int
    pswpout: int
    psi_some_avg10: float | None


class Sampler(threading.Thread):
    """Samples every ``interval_s`` until stopped; :meth:`window` summarises a time span."""

    def __init__(self, pid: int, cgroup, interval_s: float = 0.05):
        super().__init__(daemon=True, name="plimsoll-verify-sampler")
        self.pid, self.cgroup, self.interval_s = pid, cgroup, interval_s
        self.samples: list[Sample] = []
        self._halt = threading.Event()

    def sample(self) -> Sample:
        rss = 0
        for line in _read(f"/proc/{self.pid}/status").splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
        ev = self.cgroup.events() if self.cgroup else {}
        return Sample(time.monotonic(), rss,
                      (self.cgroup.usage() or 0) if self.cgroup else 0,
                      (self.cgroup.working_set() or 0) if self.cgroup else 0,
                      ev.get("failcnt", 0), ev.get("oom_kill", 0), pswpout(), psi_some_avg10())

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append(self.sample())
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def window(self, t0: float, t1: float) -> dict:
        s = [x for x in self.samples if t0 <= x.t <= t1] or [self.sample()]
        psi = [x.psi_some_avg10 for x in s if x.psi_some_avg10 is not None]
        return {"samples": len(s), "peak_rss_bytes": max(x.rss for x in s),
                "peak_usage_bytes": max(x.usage for x in s),
                "peak_working_set_bytes": max(x.working_set for x in s),
                "failcnt_delta": s[-1].failcnt - s[0].failcnt,
                "oom_kill_delta": s[-1].oom_kill - s[0].oom_kill,
                "pswpout_delta": s[-1].pswpout - s[0].pswpout,
                "psi_some_avg10_max": max(psi) if psi else None}


# --- one phase ----------------------------------------------------------------------------
@dataclass
class Phase:
    kind: str
    passed: bool = False
    answers: dict[str, int] = field(default_factory=dict)  # "200", "503 memory_trip", …
    notes: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0


class Run:
    """The worker under test and the helpers every phase uses."""

    def __init__(self, url: str, model_name: str, vocab: int, cfg, status: dict, proc, guard):
        self.url, self.model_name, self.vocab = url, model_name, vocab
        self.cfg, self.proc, self.guard = cfg, proc, guard
        self.status = status

    def post(self, prompt, max_tokens: int, timeout: float = 120.0) -> str:
        import httpx

        try:
            r = httpx.post(f"{self.url}/v1/completions", timeout=timeout,
                           json={"model": self.model_name, "prompt": prompt,
                                 "max_tokens": max_tokens, "temperature": 0.0})
        except httpx.HTTPError as err:
            return f"error {type(err).__name__}"
        if r.status_code == 200:
            return "200"
        try:
            code = r.json()["error"].get("code") or ""
        except (ValueError, KeyError, AttributeError):
            code = ""
        return f"{r.status_code} {code}".strip()

    def prompt(self, n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(10, self.vocab) for _ in range(n)]

    def burst(self, prompts: list, max_tokens: int) -> Counter:
        with cf.ThreadPoolExecutor(max(1, len(prompts))) as ex:
            return Counter(ex.map(lambda p: self.post(p, max_tokens), prompts))

    def current(self) -> dict:
        import httpx

        return httpx.get(f"{self.url}/v1/plimsoll/status", timeout=10).json()

    def recovers(self, within_s: float = 20.0) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.post([11, 12, 13], 2) == "200":
                return True
            time.sleep(0.3)
        return False


CONTROLLED = ("200", "503", "429", "400")


def _controlled(answers: Counter) -> bool:
    return all(a.split()[0] in CONTROLLED for a in answers)


def phase_first_inference(run: Run) -> Phase:
    ph = Phase("first_inference")
    n = run.cfg.context - run.cfg.default_max_tokens
    got = run.burst([run.prompt(n, i) for i in range(run.cfg.max_num_seqs)],
                    run.cfg.default_max_tokens)
    ph.answers = dict(got)
    ph.notes.append(f"{run.cfg.max_num_seqs} × {n}-token prompts at once")
    ph.passed = _controlled(got)
    return ph


def phase_long_prefill(run: Run) -> Phase:
    ph = Phase("long_prefill")
    n = run.cfg.context - run.cfg.default_max_tokens
    fits = run.post(run.prompt(n, 100), run.cfg.default_max_tokens)
    over = run.post(run.prompt(run.cfg.context + 1, 101), run.cfg.default_max_tokens)
    ph.answers = dict(Counter([fits, over]))
    ph.notes.append(f"{n} tokens: {fits}; {run.cfg.context + 1} tokens (over): {over}")
    ph.passed = fits in ("200", "503 memory_trip") and over.startswith("400")
    return ph


def phase_overload(run: Run) -> Phase:
    ph = Phase("overload")
    n = run.cfg.max_num_seqs + run.cfg.max_queue + 4
    got = run.burst([run.prompt(512, 200 + i) for i in range(n)], run.cfg.max_tokens)
    ph.answers = dict(got)
    refused = sum(v for k, v in got.items() if k.split()[0] in ("503", "429"))
    ph.notes.append(f"{n} requests for {run.cfg.max_num_seqs} slots + "
                    f"{run.cfg.max_queue} queue places; {refused} refused")
    ph.passed = _controlled(got) and refused >= 1
    return ph


def phase_spike(run: Run, kind: str) -> Phase:
    ph = Phase(f"{kind}_spike")
    if run.guard is None:
        ph.notes.append("skipped: the worker has no cgroup of its own")
        ph.passed = True
        return ph
    cg = run.guard.cgroup
    helper = subprocess.Popen(run.guard.wrap([sys.executable, "-m", "plimsoll.engine.spike",
                                              kind]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if helper.stdout.readline().strip() != "READY":
            ph.notes.append(f"the spike helper did not start (exit {helper.poll()})")
            return ph
        # sized now, with the helper's own interpreter already charged: halfway between
        # the soft and the hard line
        st = run.current()["cgroup"]
        hard, soft, ws = st["limit_bytes"], st["soft_bytes"], cg.working_set() or 0
        mib = max(1, (soft + (hard - soft) // 2 - ws) // MIB)
        helper.stdin.write(f"{mib}\n")
        helper.stdin.flush()
        if not helper.stdout.readline().startswith("HELD"):
            ph.notes.append(f"the spike helper did not hold memory (exit {helper.poll()})")
            return ph
        time.sleep(0.3)
        during = cg.working_set() or 0
        got = run.burst([run.prompt(256, 300 + i) for i in range(run.cfg.max_num_seqs)], 8)
    finally:
        helper.stdin.close()
        helper.wait(30)
    ph.answers = dict(got)
    ph.figures = {"spike_bytes": mib * MIB, "working_set_before": ws,
                  "working_set_during": during, "soft_bytes": soft, "limit_bytes": hard}
    trips = got.get("503 memory_trip", 0)
    recovered = run.recovers()
    ph.notes.append(f"{mib} MiB {kind} spike took the working set from {ws} to {during} B "
                    f"(soft line {soft}, hard line {hard}); {trips} requests answered "
                    f"503 memory_trip; served again after release: {recovered}")
    ph.passed = _controlled(got) and trips >= 1 and recovered and helper.returncode == 0
    return ph


PHASES = {"first_inference": phase_first_inference, "long_prefill": phase_long_prefill,
          "overload": phase_overload,
          "mlx_spike": lambda r: phase_spike(r, "mlx"),
          "numpy_spike": lambda r: phase_spike(r, "numpy")}


# --- the whole run ------------------------------------------------------------------------
def run_verify(model_dir: Path, *, limit_bytes: int = 1024 * MIB, concurrency: int = 4,
               context: int = 2048, max_tokens: int = 16, kinds: tuple[str, ...] = FAULT_KINDS,
               report: Reporter = lambda _m: None, env: dict[str, str] | None = None) -> dict:
    """Start a guarded worker, inject each fault kind, return the report (a JSON dict)."""
    from . import guard as G
    from . import live_admission as LA
    from .launch import free_port, start_worker, stop_worker, worker_config

    model_dir = Path(model_dir)
    budget = limit_bytes - G.RUNTIME_RESERVE_BYTES
    if budget <= 0:
        raise ValueError(f"--limit-mib must exceed the {G.RUNTIME_RESERVE_BYTES // MIB} MiB "
                         "runtime reserve")
    figures = LA.MemoryFigures(limit_bytes, limit_bytes, budget,
                               "verify: the cgroup limit is the ceiling")
    facts, _, decision = LA.plan(model_dir, None, None, figures,
                                 LA.Wanted(concurrency=concurrency, context=context,
                                           max_tokens=max_tokens))
    if not decision.admitted:
        raise RuntimeError("admission refused the model under this limit: "
                           + "; ".join(decision.reasons))
    cfg = worker_config(model_dir, model_dir.name, facts, decision, None, None,
                        port=free_port(), max_queue=4, max_wait_s=20.0)
    report(f"starting the worker under a {limit_bytes // MIB} MiB cgroup limit")
    t_start = time.monotonic()
    proc, status = start_worker(cfg, cgroup_limit_bytes=limit_bytes, env=env)
    guard = proc.plimsoll_guard
    sampler = Sampler(proc.pid, guard.cgroup if guard else None)
    sampler.start()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    run = Run(f"http://{cfg.host}:{cfg.port}", cfg.model_name, vocab, cfg, status, proc, guard)
    phases: list[Phase] = []
    try:
        for kind in kinds:
            report(f"fault: {kind}")
            t0 = time.monotonic()
            ph = PHASES[kind](run)
            ph.seconds = round(time.monotonic() - t0, 2)
            ph.figures.update(sampler.window(t0, time.monotonic()))
            phases.append(ph)
            report(f"{kind}: {'pass' if ph.passed else 'FAIL'} {ph.answers}")
            if proc.poll() is not None:
                report(f"the worker exited ({proc.returncode}); stopping")
                break
        final = run.current() if proc.poll() is None else {}
    finally:
        alive = proc.poll() is None
        whole = sampler.window(t_start, time.monotonic())
        stop_worker(proc)
        sampler.stop()
    oom = whole["oom_kill_delta"]
    pageouts = whole["pswpout_delta"]
    passed = alive and oom == 0 and pageouts == 0 and all(p.passed for p in phases)
    return {
        "passed": passed, "platform": sys.platform,
        "guard": ({"cgroup": str(guard.cgroup.path), "limit_bytes": limit_bytes}
                  if guard else None),
        "worker": {"model_dir": str(model_dir), "concurrency": cfg.max_num_seqs,
                   "context": cfg.context, "max_queue": cfg.max_queue,
                   "pool_blocks": cfg.max_cache_blocks, "alive_at_end": alive,
                   "soft_bytes": (final.get("cgroup") or {}).get("soft_bytes")},
        "totals": {**whole, "oom_kills": oom, "page_outs": pageouts,
                   "swap_configured": Path("/proc/swaps").exists()
                   and len(_read("/proc/swaps").splitlines()) > 1},
        "phases": [asdict(p) for p in phases],
        "not_run": [k for k in FAULT_KINDS if k not in kinds]
        + ["mmap prefetch", "load-time spike (second model load)", "mlx_lm.server contrast"],
    }


def summary(result: dict) -> str:
    """The readable half of the report."""
    mb = lambda b: "n/a" if b is None else f"{b / MIB:.1f} MiB"  # noqa: E731
    t = result["totals"]
    lines = [f"plimsoll verify: {'PASS' if result['passed'] else 'FAIL'}",
             f"  limit: {mb((result['guard'] or {}).get('limit_bytes'))} "
             f"(soft line {mb(result['worker']['soft_bytes'])}), cgroup "
             f"{(result['guard'] or {}).get('cgroup', 'none')}",
             f"  OOM kills: {t['oom_kills']}   page-outs: {t['page_outs']} "
             f"(swap configured: {t['swap_configured']})   cgroup failcnt: "
             f"{t['failcnt_delta']}   PSI some avg10 max: {t['psi_some_avg10_max']}",
             f"  peak cgroup usage: {mb(t['peak_usage_bytes'])}   peak RSS: "
             f"{mb(t['peak_rss_bytes'])}", ""]
    for p in result["phases"]:
        f = p["figures"]
        lines.append(f"  [{'pass' if p['passed'] else 'FAIL'}] {p['kind']:<16} peak usage "
                     f"{mb(f.get('peak_usage_bytes'))}, peak RSS {mb(f.get('peak_rss_bytes'))}, "
                     f"answers {p['answers']} ({p['seconds']} s)")
        for note in p["notes"]:
            lines.append(f"      {note}")
    lines.append(f"  not run: {', '.join(result['not_run'])}")
    return "\n".join(lines)


def write_report(result: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    js, txt = out_dir / f"verify-{stamp}.json", out_dir / f"verify-{stamp}.txt"
    js.write_text(json.dumps(result, indent=2) + "\n")
    txt.write_text(summary(result) + "\n")
    return js, txt

