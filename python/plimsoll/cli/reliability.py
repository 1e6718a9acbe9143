"""``plimsoll calibrate`` and ``plimsoll verify``: measured peaks and the fault-injection run.

Click command objects only; ``cli.py`` registers them (``main.add_command``). Both
commands start a real worker through the launch wrapper (in its own memory cgroup when
running as root with a writable controller) and report progress while they run.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from plimsoll.cli.common import UsageFailure
from plimsoll.reliability.verify.faults import FAULT_KINDS

_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


def _model_or_demo(model_dir: Path | None) -> Path:
    if model_dir is not None:
        return model_dir
    from plimsoll.core.progress import progress
    from plimsoll.launch.defaults import ensure_demo_model

    with progress("demo model") as report:
        return ensure_demo_model(report=report)


@click.command("calibrate")
@click.argument("model_dir", type=_DIR, required=False)
@click.option("--concurrency", type=click.IntRange(min=1), help="Concurrent first requests.")
@click.option("--context", type=click.IntRange(min=2), help="Configured total context.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Output tokens per request (the prompt fills the rest of the context).")
@click.option("--json", "as_json", is_flag=True, help="Print the measurement as JSON.")
def calibrate_command(model_dir, concurrency, context, max_tokens, as_json) -> None:
    """Measure MODEL_DIR's real peak at the configured concurrency and context.

    Loads the model in a worker, sends CONCURRENCY simultaneous prompts that fill the
    context, and records the peak (MLX peak, RSS high-water, cgroup max usage) under the
    cache directory, keyed by the weights hash, engine version and KV dtype. Admission
    then reserves max(formula, measured): what was not accounted for is reserve.
    """
    from plimsoll.core.progress import progress
    from plimsoll.reliability.calibrate import calibrate

    model_dir = _model_or_demo(model_dir)
    try:
        with progress("calibrate") as report:
            path, m = calibrate(model_dir, concurrency=concurrency, context=context,
                                max_tokens=max_tokens, report=report)
    except (RuntimeError, OSError, ValueError) as err:
        raise UsageFailure(f"calibration failed: {err}") from None
    if as_json:
        click.echo(json.dumps({"path": str(path), **m.__dict__}, indent=2))
        return
    mib = 1 << 20
    cg = m.cgroup_max_usage_bytes
    click.echo(f"calibration: {path}\n"
               f"  concurrency {m.concurrency} × context {m.context} "
               f"({m.prompt_tokens} prompt + {m.max_tokens} output tokens)\n"
               f"  peak {m.peak_bytes / mib:.1f} MiB = max(MLX {m.mlx_peak_bytes / mib:.1f}, "
               f"RSS high-water {m.rss_hwm_bytes / mib:.1f}, cgroup "
               f"{'n/a' if cg is None else f'{cg / mib:.1f}'}) MiB\n"
               f"  weights {m.weights_bytes / mib:.1f} MiB, KV held {m.kv_bytes_peak / mib:.1f} MiB"
               f" → measured reserve {m.reserve_bytes / mib:.1f} MiB")


@click.command("verify")
@click.argument("model_dir", type=_DIR, required=False)
@click.option("--limit-mib", type=click.IntRange(min=640), default=1024, show_default=True,
              help="The cgroup hard limit for the worker (and for mlx_lm.server in the "
                   "contrast); it stands in for the wired ceiling.")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--context", type=click.IntRange(min=64), default=2048, show_default=True)
@click.option("--fault", "faults", multiple=True, type=click.Choice(FAULT_KINDS),
              help="Fault kinds to inject (repeatable; default: all, in this order: "
                   + ", ".join(FAULT_KINDS) + ").")
@click.option("--contrast/--no-contrast", default=None,
              help="Also drive mlx_lm.server under the same limit and workload "
                   "[default: on when mlx_lm is installed and a cgroup can be made].")
@click.option("--mmap-mib", type=click.IntRange(min=1),
              help="Size of the scratch file the prefetch fault maps [default: 1.5 × limit].")
@click.option("--scratch-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the scratch file goes (a disk, not tmpfs: its pages must be "
                   "reclaimable) [default: the system temp dir].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where to write the JSON and Markdown report (default: cache dir/verify).")
@click.option("--soak", is_flag=True,
              help="Instead of the faults: soak `plimsoll serve` (MODEL_DIR as model a, "
                   "--model-b as b) under a memory cgroup of --limit-mib for --duration: 2-8 "
                   "clients, prompt-cache churn, growing sessions, cancellations, swaps and "
                   "idle unloads; then mlx_lm.server the same way (--contrast).")
@click.option("--duration", type=click.FloatRange(min=5), default=30.0, show_default=True,
              help="--soak: seconds of load per server.")
@click.option("--contrast-duration", type=click.FloatRange(min=5),
              help="--soak: seconds of load for mlx_lm.server [default: --duration].")
@click.option("--model-b", type=_DIR, help="--soak: the second model [default: MODEL_DIR "
              "again, under another name: still a second worker and a swap].")
def verify_command(model_dir, limit_mib, concurrency, context, faults, contrast, mmap_mib,
                   scratch_dir, out_dir, soak, duration, contrast_duration, model_b) -> None:
    """Fault-inject a guarded worker and check it never crosses its line.

    Each fault kind runs in turn (the last, several at once) while RSS, MLX active memory,
    the cgroup's usage, fail count and OOM kills, page-outs and pressure are sampled; then
    the same workload is driven against mlx_lm.server in its own cgroup with the same limit.
    Pass = zero OOM kills, zero page-outs, and every overload answered with a controlled
    503/429 (or a 400 naming the limit). Exit status 0 on pass, 1 on failure.
    """
    from plimsoll.core.paths import cache_dir, private_dir
    from plimsoll.core.progress import progress
    from plimsoll.reliability.verify import run_verify, summary, write_report

    model_dir = _model_or_demo(model_dir)
    try:  # a directory named on the command line is the user's to choose, as it is
        out_dir = out_dir or private_dir(cache_dir() / "verify", "verify reports and logs")
    except OSError as err:
        raise UsageFailure(str(err)) from None
    if soak:
        run_soak_command(model_dir, model_b or model_dir, limit_mib << 20, concurrency,
                         context, duration, contrast, contrast_duration, out_dir)
    if scratch_dir is not None:  # the scratch file goes in a 0700 temp dir inside it
        scratch_dir.mkdir(parents=True, exist_ok=True)
    try:
        with progress("verify") as report:
            result = run_verify(model_dir, limit_bytes=limit_mib << 20,
                                concurrency=concurrency, context=context,
                                kinds=tuple(faults) or FAULT_KINDS, report=report,
                                contrast=contrast, scratch_dir=scratch_dir,
                                mmap_bytes=(mmap_mib << 20) if mmap_mib else None,
                                log_dir=out_dir)
    except (RuntimeError, ValueError, OSError) as err:
        raise UsageFailure(f"verify could not run: {err}") from None
    js, md = write_report(result, out_dir)
    click.echo(summary(result))
    click.echo(f"report: {js}\n        {md}")
    raise SystemExit(0 if result["passed"] else 1)


def run_soak_command(model_a: Path, model_b: Path, limit_bytes: int, concurrency: int,
                     context: int, duration: float, contrast: bool | None,
                     contrast_duration: float | None, out_dir: Path) -> None:
    """``verify --soak``: the soak, its report written, exit 0 on pass."""
    import os
    import tempfile

    from plimsoll.core.progress import progress
    from plimsoll.reliability.soak import Shape, Soak, run_soak, write
    from plimsoll.reliability.verify.contrast import unavailable_reason

    why = unavailable_reason()
    if contrast and why:
        raise UsageFailure(f"--contrast: {why}")
    ttl = 4.0  # an idle gap outlasts the TTL by 3 s: the proxy unloads, the next request loads
    shape = Shape(duration_s=duration, phase_s=max(2.0, duration / 8),
                  idle_every_s=max(20.0, duration / 2), idle_gap_s=ttl + 3)
    spec = Soak(model_a, model_b, limit_bytes, shape, context=context,
                concurrency=concurrency, idle_ttl_s=ttl, env=dict(os.environ))
    work = Path(tempfile.mkdtemp(prefix="plimsoll-soak-"))
    try:
        with progress("soak") as report:
            result = run_soak(spec, work, contrast=why is None if contrast is None else contrast,
                              contrast_duration_s=contrast_duration, report=report)
    except (RuntimeError, ValueError, OSError) as err:
        raise UsageFailure(f"the soak could not run: {err} (logs in {work})") from None
    js, md = write(result, out_dir)
    click.echo(md.read_text())
    click.echo(f"report: {js}\n        {md}\nlogs:   {work}")
    raise SystemExit(0 if result["passed"] else 1)
