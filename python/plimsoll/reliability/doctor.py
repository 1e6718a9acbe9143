"""``plimsoll doctor``'s judgement: from readings to one line per finding, each fix named.

Pure (no I/O): the CLI reads the probe, the policy, each registered model's admission
and, if asked, a proxy's ``/running``, then hands the values here. Tests build the
values by hand, so every warning can be produced on a Linux CI host — including the
macOS ones, from a snapshot whose platform is ``darwin``.

What is checked (docs/DESIGN.md, "The arithmetic"):
- the ceiling against the mode's budget. On macOS the watcher sets
  ``iogpu.wired_limit_mb`` to the budget (MiB, exact); unset, below or above it is a
  warning whose fix is the exact ``sysctl`` command (or the link watcher). On Linux the
  ceiling is ``min(cgroup limit, MemTotal)`` and a ceiling above the budget is normal
  (the budget binds); one below it can never hold the budget.
- wired memory in use above the budget (macOS: something wired past the line);
- each registered model alone against the envelope: its ``u`` band, an empty band, a
  model that cannot hold one sequence, and one admitted below its configured context or
  concurrency. Co-resident sums are the proxy's job, not checked here;
- the MLX workers get (Metal on macOS) and the cluster backend sharded models would run
  on (the policy's ``cluster.backend`` against what MLX reports available).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from plimsoll.cluster.backend import Availability, choose
from plimsoll.core.admission import AdmissionDecision
from plimsoll.core.policy import Mode, Policy
from plimsoll.core.sizing import blocks_for
from plimsoll.core.units import GIB, bytes_to_mib_floor, fmt_bytes, mib_to_bytes
from plimsoll.probes.snapshot import MemorySnapshot

Level = Literal["ok", "warn", "error"]
WATCHER = "or install the link watcher (it sets it per mode)"


@dataclass(frozen=True)
class Line:
    level: Level
    text: str


@dataclass(frozen=True)
class ModelCheck:
    """One registered model: its admission, or why it could not be inspected."""

    name: str
    path: str
    decision: AdmissionDecision | None = None
    error: str | None = None


@dataclass(frozen=True)
class RunningWorker:
    model: str
    state: str = "?"
    pid: int | None = None
    memory_bytes: int | None = None


@dataclass(frozen=True)
class ProxyView:
    """What a proxy at ``url`` reports running; ``error`` when it could not be asked."""

    url: str
    workers: tuple[RunningWorker, ...] = ()
    error: str | None = None


def diagnose(
    snapshot: MemorySnapshot,
    policy: Policy,
    mode: Mode,
    models: Sequence[ModelCheck],
    proxy: ProxyView | None = None,
    policy_source: str = "policy",
    mlx: MlxView | None = None,
    backends: Availability | None = None,
) -> list[Line]:
    """Every finding, in reading order: ceiling, memory, budgets, ceiling vs budget, models,
    the MLX workers get and its distributed backends (when read), what is loaded."""
    budget = policy.budget_bytes(mode)
    lines = [
        Line("ok", f"ceiling {fmt_bytes(snapshot.ceiling_bytes)} "
                   f"({snapshot.ceiling_bytes} B) from {snapshot.ceiling_source}; "
                   f"total RAM {fmt_bytes(snapshot.total_ram_bytes)} ({snapshot.platform})"),
        Line("ok", f"memory in use {fmt_bytes(snapshot.in_use_bytes)}"
                   + (" wired" if snapshot.platform == "darwin" else "")
                   + f"; pressure {snapshot.pressure}"
                   + (f" ({snapshot.pressure_detail})" if snapshot.pressure_detail else "")
                   + f"; {snapshot.page_outs} page-outs since boot"),
        _budgets_line(policy, mode, policy_source),
        *_ceiling_vs_budget(snapshot, policy, mode, budget),
    ]
    if not models:
        lines.append(Line("ok", f"models: none registered in {policy_source} "
                                "(add them under `models` to have them checked)"))
    for check in models:
        lines.extend(_model_lines(check, policy, mode, snapshot))
    if mlx is not None:
        lines.extend(mlx_lines(mlx, snapshot.platform))
    if backends is not None:
        lines.extend(cluster_backend_lines(policy, backends))
    lines.extend(_loaded_lines(proxy))
    return lines


@dataclass(frozen=True)
class MlxView:
    """What this Python's MLX reports (read in a child process); ``error`` if it won't import."""

    version: str | None = None
    metal: bool = False
    device: str | None = None
    error: str | None = None
    #: the engine's custom-kernel verdicts on this device (plimsoll.engine.kernels), as dicts
    kernels: tuple = ()


def mlx_lines(mlx: MlxView, platform: str) -> list[Line]:
    """The MLX the workers will run: on macOS it must have Metal (the GPU, MLX's memory
    limit and the wired limit the watcher governs); elsewhere the CPU (or CUDA) backend."""
    if mlx.error is not None:
        fix = ("install plimsoll's package (its Nix package brings the Metal wheels; with pip: "
               "pip install ./python)" if platform == "darwin"
               else "pip install './python[cpu]' (the policy and admission tools work without)")
        return [Line("error" if platform == "darwin" else "warn",
                     f"MLX: not importable ({mlx.error}): workers cannot start; {fix}")]
    if platform == "darwin" and not mlx.metal:
        return [Line("error", f"MLX {mlx.version} has no Metal GPU (device {mlx.device}): "
                              "workers would run on the CPU with no enforced memory limit; "
                              "nixpkgs' mlx is built with Metal off — use plimsoll's package "
                              "(the official Metal wheels) or pip's mlx")]
    backend = "Metal GPU" if mlx.metal else "no Metal"
    return [Line("ok", f"MLX {mlx.version}: default device {mlx.device} ({backend})"),
            *(kernel_line(k) for k in mlx.kernels)]


def kernel_line(verdict: Mapping[str, Any]) -> Line:
    """One custom kernel's self-check on this host: used, or why the reference path serves
    (a kernel that disagrees with the reference or fails is a warning: report it)."""
    head = f"kernel {verdict.get('name')} ({verdict.get('device')})"
    reason = str(verdict.get("reason", ""))
    if verdict.get("used"):
        timed = "" if verdict.get("kernel_ms") is None else (
            f" ({verdict.get('kernel_ms')} ms against the reference's "
            f"{verdict.get('reference_ms')} ms)")
        return Line("ok", f"{head}: used, {reason}{timed}")
    broken = reason.startswith(("disagrees", "failed"))
    return Line("warn" if broken else "ok",
                f"{head}: not used, {reason}; the reference path serves"
                + ("; report this line with the MLX version" if broken else ""))


def cluster_backend_lines(policy: Policy, available: Availability) -> list[Line]:
    """The backend a sharded model's ranks would run on here (the policy's
    ``cluster.backend``, ``auto`` resolved as ``plimsoll serve`` resolves it). A named
    backend MLX does not offer here is an error where a model is sharded (its load would
    be refused), a warning otherwise."""
    wanted = policy.cluster.backend
    choice = choose(wanted, available, setting="cluster.backend in the policy", local=True)
    if choice.backend is not None:
        return [Line("ok", f"cluster backend {choice.backend} ({choice.reason}); "
                           f"{available.summary()}")]
    sharded = sorted(n for n, e in policy.models.items() if e.sharded)
    level: Level = "error" if sharded else "warn"
    what = (f"sharded model(s) {', '.join(sharded)} cannot load clustered" if sharded
            else "no model is sharded yet")
    return [Line(level, f"cluster backend: {choice.reason} ({what})")]


def exit_status(lines: Iterable[Line]) -> int:
    """0 when every line is ok, 1 when anything needs fixing."""
    return 0 if all(line.level == "ok" for line in lines) else 1


def render(lines: Iterable[Line]) -> str:
    tags = {"ok": "ok   ", "warn": "WARN ", "error": "ERROR"}
    return "\n".join(f"{tags[line.level]} {line.text}" for line in lines)


def parse_running(data: Any) -> tuple[RunningWorker, ...]:
    """A proxy's ``GET /running`` body → the workers that hold memory (not ``stopped``).

    Accepts the proxy's ``{"workers": [...]}`` (or ``running``, or a bare list); each item
    names its ``model``; its memory is the observed figure, else RSS, else the admitted
    footprint."""
    if isinstance(data, Mapping):
        data = data.get("workers", data.get("running"))
    if not isinstance(data, list):
        raise ValueError("unexpected /running body: no list of workers")
    workers = []
    for item in data:
        if not isinstance(item, Mapping):
            raise ValueError("unexpected /running body: a worker is not an object")
        if item.get("state") == "stopped":
            continue
        figures = [item.get("observed_bytes"), _get(item, "memory", "rss_bytes"),
                   _get(item, "admitted", "footprint_bytes")]
        pid = item.get("pid")
        workers.append(RunningWorker(
            model=str(item.get("model", item.get("name", "?"))),
            state=str(item.get("state", "?")),
            pid=pid if isinstance(pid, int) else None,
            memory_bytes=next((f for f in figures if isinstance(f, int)), None),
        ))
    return tuple(workers)


def _get(item: Mapping, outer: str, key: str) -> Any:
    inner = item.get(outer)
    return inner.get(key) if isinstance(inner, Mapping) else None


# --- the pieces ---------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GIB:g} GiB"


def _budgets_line(policy: Policy, mode: Mode, source: str) -> Line:
    parts = []
    for m in ("standalone", "clustered"):
        b = policy.budget_bytes(m)
        parts.append(f"{m} {_gib(b)} ({bytes_to_mib_floor(b)} MiB)")
    reserve = math.floor(policy.transient_reserve * policy.budget_bytes(mode))
    return Line("ok", f"budgets from {source} (host {policy.host}): " + ", ".join(parts)
                + f"; OS floor {policy.os_floor_gb:g} GiB of {policy.total_ram_gb:g} GiB; "
                f"transient reserve {fmt_bytes(reserve)}; checking {mode} mode")


def sysctl_fix(snapshot: MemorySnapshot, budget: int) -> str:
    """The exact command that puts the wired ceiling on the budget (MiB, rounded down)."""
    mib = bytes_to_mib_floor(budget)
    if "debug.iogpu.wired_limit=" in snapshot.ceiling_source:  # macOS 13 name, in bytes
        return f"sudo sysctl debug.iogpu.wired_limit={mib_to_bytes(mib)}"
    return f"sudo sysctl iogpu.wired_limit_mb={mib}"


def raise_ceiling_fix(snapshot: MemorySnapshot, budget: int) -> str:
    if snapshot.platform == "darwin":
        return f"raise the wired ceiling to the budget: {sysctl_fix(snapshot, budget)}"
    return "raise the cgroup memory limit (e.g. systemctl set-property UNIT MemoryMax=…)"


def _ceiling_vs_budget(s: MemorySnapshot, policy: Policy, mode: Mode, budget: int) -> list[Line]:
    field = f"modes.{mode}.maxLocalLlmGb"
    ceiling, mib = s.ceiling_bytes, bytes_to_mib_floor(budget)
    if s.platform == "darwin":
        lines = [_darwin_sysctl(s, mode, budget)]
        if s.in_use_bytes > budget:
            lines.append(Line("warn", f"wired memory in use {fmt_bytes(s.in_use_bytes)} is above "
                                      f"the {mode} budget {_gib(budget)}: stop what wired it "
                                      "(mlx_lm.server wires ~75% of RAM; unload plimsoll "
                                      "workers with POST /unload on the proxy)"))
        return lines
    if ceiling < mib_to_bytes(mib):
        if s.ceiling_source.startswith("MemTotal (no cgroup"):
            fix = f"lower {field} to at most {ceiling / GIB:.2f} GiB (this host's RAM)"
        else:
            fix = (f"{raise_ceiling_fix(s, budget)} to at least {budget} B, "
                   f"or lower {field} to at most {ceiling / GIB:.2f} GiB")
        return [Line("warn", f"ceiling {fmt_bytes(ceiling)} is below the {mode} budget "
                             f"{_gib(budget)}: the budget can never be used: {fix}")]
    return [Line("ok", f"ceiling is at or above the {mode} budget {_gib(budget)}: "
                       "the budget binds (Linux has no separate wired limit)")]


def _darwin_sysctl(s: MemorySnapshot, mode: Mode, budget: int) -> Line:
    target = mib_to_bytes(bytes_to_mib_floor(budget))
    fix = f"{sysctl_fix(s, budget)}, {WATCHER}"
    if not s.ceiling_source.startswith("sysctl "):
        return Line("warn", f"iogpu.wired_limit_mb is unset: the ceiling is macOS's default "
                            f"({fmt_bytes(s.ceiling_bytes)}), not the {mode} budget "
                            f"{_gib(budget)}: set it: {fix}")
    setting = s.ceiling_source.removeprefix("sysctl ").split(";")[0]
    if s.ceiling_bytes > budget:
        return Line("warn", f"wired limit {setting} ({fmt_bytes(s.ceiling_bytes)}) is above "
                            f"the {mode} budget {_gib(budget)}: lower it: {fix}")
    if s.ceiling_bytes < target:
        return Line("warn", f"wired limit {setting} ({fmt_bytes(s.ceiling_bytes)}) is below "
                            f"the {mode} budget {_gib(budget)}: models get less than the "
                            f"policy allows: raise it: {fix}")
    return Line("ok", f"wired limit {setting} matches the {mode} budget {_gib(budget)}")


def _raise_fix(d: AdmissionDecision, policy: Policy, snapshot: MemorySnapshot,
               mode: Mode) -> str:
    """What to raise for more room: the ceiling while it is below the budget, else the budget
    when it binds below (u − margin) × ceiling, else both together."""
    field = f"modes.{mode}.maxLocalLlmGb"
    if snapshot.ceiling_bytes < mib_to_bytes(bytes_to_mib_floor(d.budget_bytes)):
        return raise_ceiling_fix(snapshot, d.budget_bytes)
    by_ceiling = math.floor(max(d.gpu_memory_utilization - policy.u_margin, 0) * d.ceiling_bytes)
    if d.budget_bytes < by_ceiling:
        return f"raise {field}"
    if snapshot.platform == "darwin":
        return f"raise {field} and the wired limit with it (sudo sysctl iogpu.wired_limit_mb=…)"
    if snapshot.ceiling_source.startswith("MemTotal"):
        return "move it to a host with more RAM (the ceiling here is all of RAM)"
    return raise_ceiling_fix(snapshot, d.budget_bytes)


def _model_lines(c: ModelCheck, policy: Policy, mode: Mode,
                 snapshot: MemorySnapshot) -> list[Line]:
    where = f"models.{c.name}"
    if c.decision is None:
        return [Line("error", f"model {c.name} at {c.path} cannot be inspected ({c.error}): "
                              f"fix {where}.path, or put the model there")]
    d = c.decision
    band = f"u band {d.band_low:.4f} < u < {d.band_high:.4f}"
    margin = policy.u_margin
    if not d.admitted:
        if d.band_high - 2 * margin <= 0 or d.band_low + margin > d.band_high - margin:
            return [Line("warn", f"model {c.name}: empty {band} (weights + reserve "
                                 f"{fmt_bytes(d.weights_bytes + d.transient_reserve_bytes)} "
                                 f"on a {fmt_bytes(d.ceiling_bytes)} ceiling, margin {margin} "
                                 f"each side): {_raise_fix(d, policy, snapshot, mode)}, or shrink "
                                 "the footprint: a smaller (or more quantized) model, a lower "
                                 "transientReserve")]
        context = min(d.requested_context, d.native_max_context or d.requested_context)
        floor_context = max(min(policy.min_context, context), d.output_reservation + 1)
        need = blocks_for(floor_context, d.block_tokens, d.fixed_blocks_per_seq)
        return [Line("warn", f"model {c.name} cannot fit one sequence of {floor_context} "
                             f"tokens ({need} blocks of {fmt_bytes(d.block_bytes)}; the pool "
                             f"left after weights {fmt_bytes(d.weights_bytes)} + reserve "
                             f"{fmt_bytes(d.transient_reserve_bytes)} is {d.pool_blocks} "
                             f"blocks): {_raise_fix(d, policy, snapshot, mode)}, lower "
                             f"{where}.maxTokens or minContext, or use a smaller model")]
    lines = [Line("ok", f"model {c.name}: {band}, u = {d.gpu_memory_utilization:.4f}; pool "
                        f"{d.pool_blocks} blocks ({fmt_bytes(d.pool_bytes)}), footprint "
                        f"{fmt_bytes(d.footprint_bytes)}; context {d.context} × concurrency "
                        f"{d.concurrency}")]
    native = d.native_max_context
    if native and d.requested_context > native:
        lines.append(Line("warn", f"model {c.name}: configured context {d.requested_context} "
                                  f"exceeds the model-native maximum {native}: set "
                                  f"{where}.context to {native}"))
    elif d.context < d.requested_context:
        lines.append(Line("warn", f"model {c.name} can't fit its configured context "
                                  f"{d.requested_context}: only {d.context} tokens fit the pool "
                                  f"({d.pool_blocks} blocks): set {where}.context to "
                                  f"{d.context} or {_raise_fix(d, policy, snapshot, mode)}"))
    if d.concurrency < d.requested_concurrency:
        lines.append(Line("warn", f"model {c.name}: concurrency {d.requested_concurrency} × "
                                  f"{d.blocks_per_seq} blocks/seq doesn't fit the pool of "
                                  f"{d.pool_blocks} blocks, admitted {d.concurrency}: set "
                                  f"{where}.concurrency to {d.concurrency} or "
                                  f"{_raise_fix(d, policy, snapshot, mode)}"))
    return lines


def _loaded_lines(proxy: ProxyView | None) -> list[Line]:
    if proxy is None:
        return [Line("ok", "loaded: not checked (give --proxy URL to ask a running proxy)")]
    if proxy.error is not None:
        return [Line("ok", f"loaded: no proxy reachable at {proxy.url} ({proxy.error})")]
    if not proxy.workers:
        return [Line("ok", f"loaded: nothing (the proxy at {proxy.url} runs no worker)")]
    return [
        Line("ok", f"loaded: {w.model} {w.state}"
                   + (f", pid {w.pid}" if w.pid is not None else "")
                   + (f", {fmt_bytes(w.memory_bytes)}" if w.memory_bytes is not None else ""))
        for w in proxy.workers
    ]
