"""Measured-peak calibration: admit on what a first run really held (docs/DESIGN.md, "The
invariants").

The formula counts weights, the KV pool and a transient reserve; a real process also
holds activations of a full-context prefill at full concurrency, MLX's buffer cache,
tokenizer and interpreter state, glibc arenas. ``plimsoll calibrate`` loads the model in a
real worker (through the launch wrapper, in its own cgroup where it can), sends
``concurrency`` concurrent requests whose prompts fill the configured context, and records
the observed peak: MLX's peak, the RSS high-water mark (``VmHWM``) and, on Linux, the
cgroup's ``max_usage``. Everything above the weights and the KV actually held is
*unknown* and becomes reserve — never free capacity:

    measured_reserve = max(peaks) − weights − kv_bytes_peak

Admission then takes ``transient_reserve = max(policy fraction, measured_reserve / budget)``,
so its footprint (weights + reserve + pool) is ``≥ max(formula, measured peak)``.

This module is the run; the records it writes, and their reading at admission, are
:mod:`plimsoll.launch.calibration` (so admission does not depend on this tool).
"""

from __future__ import annotations

import json
import random
import time
from concurrent import futures
from pathlib import Path

from plimsoll.core.progress import Reporter
from plimsoll.launch.calibration import Measurement, calibration_key, save_measurement


# --- the run ------------------------------------------------------------------------------
def vmhwm(pid: int) -> int:
    """The RSS high-water mark of ``pid`` (Linux ``VmHWM``), else its current RSS."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return psutil.Process(pid).memory_info().rss


def first_requests(url: str, model_name: str, concurrency: int, prompt_tokens: int,
                   max_tokens: int, vocab: int, timeout_s: float = 600.0) -> list[int]:
    """``concurrency`` simultaneous completions with prompts of ``prompt_tokens`` ids."""
    import httpx

    def one(i: int) -> int:
        rng = random.Random(i)
        prompt = [rng.randrange(10, vocab) for _ in range(prompt_tokens)]
        r = httpx.post(f"{url}/v1/completions", timeout=timeout_s,
                       json={"model": model_name, "prompt": prompt, "max_tokens": max_tokens,
                             "temperature": 0.0})
        return r.status_code

    with futures.ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(one, range(concurrency)))


def calibrate(model_dir: Path, *, concurrency: int | None = None, context: int | None = None,
              max_tokens: int = 16, report: Reporter = lambda _msg: None,
              root: Path | None = None, policy=None, figures=None,
              env: dict[str, str] | None = None) -> tuple[Path, Measurement]:
    """Load, run the first requests at full context and concurrency, record the peak."""
    import httpx

    from plimsoll.launch import live_admission
    from plimsoll.launch.spawn import start_worker, stop_worker, worker_config
    from plimsoll.probes import read_snapshot
    from plimsoll.web.serve import free_port

    model_dir = Path(model_dir)
    if figures is None:
        figures = live_admission.memory_figures(policy, "standalone",
                                                live_admission.MemoryOverrides(), read_snapshot)
    report("inspecting the model and admitting it on the formula")
    wanted = live_admission.Wanted(concurrency=concurrency, context=context,
                                   max_tokens=max_tokens)
    facts, _, decision = live_admission.plan(model_dir, None, policy, figures, wanted,
                                             calibrated=False)
    if not decision.admitted:
        raise RuntimeError("admission refused the model on the formula alone: "
                           + "; ".join(decision.reasons))
    cfg = worker_config(model_dir, model_dir.name, facts, decision, None, policy,
                        port=free_port())
    prompt_tokens = decision.context - decision.output_reservation
    report(f"loading in a worker (concurrency {decision.concurrency}, context "
           f"{decision.context}, pool {decision.pool_blocks} blocks)")
    t0 = time.monotonic()
    proc, status = start_worker(cfg, footprint_bytes=decision.footprint_bytes, env=env)
    try:
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        report(f"first inference: {decision.concurrency} × {prompt_tokens}-token prompts "
               f"+ {decision.output_reservation} output tokens")
        codes = first_requests(f"http://{cfg.host}:{cfg.port}", cfg.model_name,
                               decision.concurrency, prompt_tokens,
                               decision.output_reservation, vocab)
        status = httpx.get(f"http://{cfg.host}:{cfg.port}/v1/plimsoll/status", timeout=10).json()
        rss_hwm = vmhwm(proc.pid)
    finally:
        stop_worker(proc)
    if any(c != 200 for c in codes):
        raise RuntimeError(f"calibration requests were not all served: {codes}; the peak "
                           "would be an underestimate")
    cg = status.get("cgroup") or {}
    mlx_peak = status["mlx"]["peak_bytes"]
    peak, reserve = Measurement.derive(facts.weights_bytes, status["kv_bytes_peak"], mlx_peak,
                                       rss_hwm, cg.get("max_usage_bytes"))
    m = Measurement(
        concurrency=decision.concurrency, context=decision.context,
        prompt_tokens=prompt_tokens, max_tokens=decision.output_reservation,
        weights_bytes=facts.weights_bytes, kv_bytes_peak=status["kv_bytes_peak"],
        mlx_peak_bytes=mlx_peak, rss_hwm_bytes=rss_hwm,
        cgroup_max_usage_bytes=cg.get("max_usage_bytes"), peak_bytes=peak,
        reserve_bytes=reserve, formula_footprint_bytes=decision.footprint_bytes,
        requests_ok=codes.count(200), seconds=round(time.monotonic() - t0, 2),
        at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    path = save_measurement(calibration_key(model_dir, facts.kv_format), facts, model_dir, m,
                            root)
    report(f"peak {peak} B (MLX {mlx_peak}, RSS high-water {rss_hwm}, cgroup "
           f"{cg.get('max_usage_bytes')}); measured reserve {reserve} B → {path}")
    return path, m
