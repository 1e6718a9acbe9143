"""What every results file carries, and how it is written.

A run writes ``<out-dir>/<name>.json`` (every figure, raw) and ``<name>.md`` (for people).
The default name is ``<measurement>-<machine>-<date>`` (:func:`default_name`), the machine
being the GPU's model where there is one (``h200``) and ``cpu`` otherwise. Every markdown
table is written by :func:`table`; the JSON records the exact command (:func:`command`) and
the host (:func:`host_facts`), so each file says how to make it again.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
RESULTS = BENCH / "results"
OUT = BENCH / "out"  # server logs and scratch, ignored by git
GiB = 2**30
DASH = "–"


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table: one header row, a rule, one line per row; None prints as –."""
    def cell(x: object) -> str:
        return DASH if x is None else str(x).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return out


def num(x: float | None, fmt: str = ".3g") -> str:
    return DASH if x is None else format(x, fmt)


def gib(x: float | None, fmt: str = ".2f") -> str:
    return DASH if x is None else f"{x / GiB:{fmt}}"


def gb(x: float | None, fmt: str = ".2f") -> str:
    return DASH if x is None else f"{x / 1e9:{fmt}}"


def medians(runs: list[dict], *keys: str) -> dict:
    """The first run's details and, for each of ``keys``, every run's value and their median."""
    out = {k: v for k, v in runs[0].items() if k not in ("text", "times")
           and not k.startswith("t_")}
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[f"{key}_runs"] = values
        out[key] = statistics.median(values) if values else None
    return out


def quantile(xs: list[float], q: float) -> float:
    """Nearest-rank quantile (q in [0, 1]) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


def spread(xs: list[float]) -> dict:
    """n, p50, p99, mean, min, max of a list (just n when empty)."""
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": quantile(xs, 0.5), "p99": quantile(xs, 0.99),
            "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs)}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def dist_version(name: str) -> str | None:
    """The installed version of ``name`` (or of its CUDA/CPU build)."""
    for dist in (name, f"{name}-cuda-13", f"{name}-cuda", f"{name}-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def machine() -> str:
    """A short name for this machine in output names: the GPU model (``NVIDIA H200`` → ``h200``),
    ``mac`` on Apple silicon, else ``cpu``."""
    if name := gpu_name():
        return name.split()[-1].lower()
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "mac"
    return "cpu"


def default_name(measurement: str, qualifier: str | None = None) -> str:
    """``<measurement>-<machine>-<date>``, then ``-<qualifier>`` where one day and machine hold
    more than one run of a measurement."""
    base = f"{measurement}-{machine()}-{time.strftime('%Y-%m-%d')}"
    return f"{base}-{qualifier}" if qualifier else base


def command() -> str:
    """This run's command line, the script relative to the repository root when it is inside."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(BENCH.parent))
    except ValueError:
        shown = sys.argv[0]
    return shlex.join(["python", shown, *sys.argv[1:]])


def git_head() -> tuple[str, bool | None]:
    """(short HEAD, whether the tree has uncommitted changes) of the repository, or ("?", None)."""
    try:
        head = subprocess.run(["git", "-C", str(BENCH), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=False)
        dirty = subprocess.run(["git", "-C", str(BENCH), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "?", None
    return head.stdout.strip() or "?", bool(dirty.stdout.strip())


def host_facts() -> dict:
    import psutil

    head, dirty = git_head()
    return {"platform": platform.platform(), "machine": machine(), "cpus": os.cpu_count(),
            "total_ram": psutil.virtual_memory().total, "python": sys.version.split()[0],
            "mlx": dist_version("mlx"), "mlx_lm": dist_version("mlx-lm"), "gpu": gpu_name(),
            "git_head": head, "worktree_dirty": dirty, "loadavg_start": loadavg()}


def host_line(host: dict) -> str:
    dirty = " (uncommitted changes)" if host.get("worktree_dirty") else ""
    return (f"Host: {host.get('gpu') or host.get('platform')}, {host.get('cpus')} CPUs, "
            f"{(host.get('total_ram') or 0) / GiB:.1f} GiB RAM; Python {host.get('python')}, "
            f"mlx {host.get('mlx')}, mlx-lm {host.get('mlx_lm')}; plimsoll at "
            f"{host.get('git_head')}{dirty}; load average at start "
            f"{host.get('loadavg_start')}, at end {host.get('loadavg_end')}.")


def heading(title: str, result: dict) -> list[str]:
    """A result's markdown opening: ``# title: name``, its command and its host."""
    return [f"# {title}: {result['name']}", "", f"Command: `{result['command']}`", "",
            host_line(result["host"]), ""]


def write(result: dict, out_dir: Path, name: str,
          markdown: Callable[[dict], str] | None = None) -> Path:
    """``name.json`` and, given a writer, ``name.md`` under ``out_dir``; returns the base path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / name
    base.with_name(f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    if markdown is not None:
        base.with_name(f"{name}.md").write_text(markdown(result))
    print(f"wrote {base}.json" + (" and .md" if markdown else ""), flush=True)
    return base


def measured(args, measurement: str, fn: Callable):
    """``fn(args)`` between the host's facts and its load average after it: (the output's
    name, the host facts, what ``fn`` returned)."""
    host = host_facts()
    out = fn(args)
    host["loadavg_end"] = loadavg()
    return args.name or default_name(measurement), host, out


def measure_and_write(args, measurement: str, fn: Callable, markdown: Callable[[dict], str],
                      key: str = "rows", more: Callable[[object], dict] | None = None) -> int:
    """A script's main after its arguments: ``fn(args)`` measured (:func:`measured`), its
    output under ``key`` beside the name, command, host and arguments (and ``more(output)``),
    written as NAME.json and NAME.md under ``--out-dir``. Returns the exit status."""
    name, host, out = measured(args, measurement, fn)
    result = {"name": name, "command": command(), "host": host,
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              key: out, **(more(out) if more else {})}
    write(result, args.out_dir, name, markdown)
    return 0


def output_args(parser, measurement: str) -> None:
    """The two output options every script takes: ``--out-dir`` and ``--name``."""
    parser.add_argument("--out-dir", type=Path, default=RESULTS,
                        help="where NAME.json and NAME.md go (default bench/results)")
    parser.add_argument("--name", default=None,
                        help=f"output base name (default {measurement}-<machine>-<date>)")
