"""The fault kinds of ``plimsoll verify``, shared by every target and every OS.

A :class:`Target` is a server under test (plimsoll's worker, or ``mlx_lm.server`` for the
contrast) with the cgroup it runs in; a :class:`Workload` is the same set of requests and
spike sizes for both. Each ``phase_*`` function injects one fault kind and returns a
:class:`Phase` with the answers (``"200"``, ``"503 memory_trip"``, ``"error
RemoteProtocolError"`` …) and figures. ``passed`` is plimsoll's criterion (controlled
answers, a refusal where one is due, served again afterwards); for the contrast the same
record says what happened instead.

Spikes are made by :mod:`plimsoll.reliability.spike` helpers placed in the target's cgroup, so
the kernel charges them where the guard looks. Plimsoll's run sizes them against its own
soft and hard lines (halfway between) and records the sizes in the workload; the contrast
reuses those absolute sizes.

The things they drive (prompts, workload, target, helpers, the scratch file) live in
:mod:`.target`.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

from plimsoll.core.units import MIB

from .target import Helper, Prompts, Target, Workload, drop_cached

__all__ = ["FAULT_KINDS", "PHASES", "Phase", "Prompts", "Target", "Workload"]

CONTROLLED = ("200", "503", "429", "400")


# --- one phase ----------------------------------------------------------------------------
@dataclass
class Phase:
    kind: str
    passed: bool = False
    answers: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0
    target_alive: bool = True


def controlled(answers: Counter | dict) -> bool:
    return all(a.split()[0] in CONTROLLED for a in answers)


def refused(answers: Counter | dict) -> int:
    return sum(v for k, v in answers.items() if k.split()[0] in ("503", "429"))


def _fill(w: Workload) -> int:
    """Prompt tokens that fill the context beside the default output."""
    return w.context - w.default_max_tokens - 4


def phase_first_inference(t: Target, w: Workload) -> Phase:
    ph = Phase("first_inference")
    n = _fill(w)
    got = t.burst([t.prompts.text(n, i) for i in range(w.concurrency)], w.default_max_tokens)
    ph.answers = dict(got)
    ph.notes.append(f"{w.concurrency} × ≤{n}-token prompts at once")
    ph.passed = controlled(got)
    return ph


#: How far past the configured context the long prompts go (agentic clients resend the
#: whole, growing conversation; nothing stops them sending more than the server holds).
OVER_FACTOR = 4


def phase_long_prefill(t: Target, w: Workload) -> Phase:
    """One prompt that fills the context, then ``concurrency`` prompts of ~4× the context at
    once: plimsoll must answer them 400 at admission (no prefill, no growth)."""
    ph = Phase("long_prefill")
    n = _fill(w)
    fits = t.post(t.prompts.text(n, 100), w.default_max_tokens)
    longs = [t.prompts.text(OVER_FACTOR * w.context, 101 + i) for i in range(w.concurrency)]
    over = t.burst(longs, w.default_max_tokens)
    ph.answers = dict(Counter([fits]) + over)
    ph.notes.append(f"≤{n} tokens: {fits}; then {w.concurrency} × "
                    f"{min(map(t.prompts.count, longs))}–{max(map(t.prompts.count, longs))} "
                    f"tokens at once (past the {w.context}-token context): {dict(over)}")
    ph.passed = (fits in ("200", "503 memory_trip")
                 and all(k.startswith("400") for k in over))
    return ph


def phase_overload(t: Target, w: Workload) -> Phase:
    ph = Phase("overload")
    n = w.concurrency + w.max_queue + 4
    got = t.burst([t.prompts.text(512, 200 + i) for i in range(n)], w.max_tokens)
    ph.answers = dict(got)
    ph.notes.append(f"{n} requests of ≤512 tokens, {w.max_tokens} out, for {w.concurrency} "
                    f"slots + {w.max_queue} queue places; {refused(got)} refused")
    ph.passed = controlled(got) and refused(got) >= 1
    return ph


def _spike_mib(t: Target, share: float = 0.5) -> tuple[int, dict]:
    """A spike that takes the working set ``share`` of the way from the soft line to the
    hard one (past the soft line, so requests meanwhile must be refused)."""
    soft, hard = t.lines()
    ws = t.working_set()
    mib = max(1, (soft + int((hard - soft) * share) - ws) // MIB)
    return mib, {"working_set_before": ws, "soft_bytes": soft, "limit_bytes": hard}


def _spike_verdict(t: Target, ph: Phase, got: Counter, rc: int | None, what: str) -> Phase:
    """A held spike passes when it was really held, every request meanwhile was answered in
    a controlled way (at least one 503 memory_trip), and the target serves again after."""
    ph.answers = dict(got)
    trips = got.get("503 memory_trip", 0)
    recovered = t.recovers()
    f = ph.figures
    ph.notes.append(f"{what} (held: {f['helper_held']}, helper exit {rc}) took the working set "
                    f"from {f['working_set_before'] // MIB} to {f['working_set_during'] // MIB} "
                    f"MiB; {trips} answered 503 memory_trip; served again after: {recovered}")
    ph.passed = (controlled(got) and trips >= 1 and recovered and rc == 0
                 and f["helper_held"])
    return ph


def phase_spike(t: Target, w: Workload, kind: str, env: dict | None = None) -> Phase:
    """An MLX or numpy allocation the scheduler did not plan, held while requests arrive."""
    ph = Phase(f"{kind}_spike")
    if t.cgroup is None:
        ph.notes.append("skipped: the target has no cgroup of its own")
        ph.passed = True
        return ph
    helper = Helper(t, kind, env=env)
    got: Counter = Counter()
    try:
        if helper.expect("READY") is None:
            ph.notes.append(f"the spike helper did not start (exit {helper.proc.poll()})")
            return ph
        if t.guarded:
            mib, ph.figures = _spike_mib(t)
            w.spike_mib[kind] = mib
        else:
            mib = w.spike_mib.get(kind, 0)
            ph.figures = {"working_set_before": t.working_set(),
                          "limit_bytes": t.lines()[1]}
        helper.send(str(mib))
        held = helper.expect("HELD")
        time.sleep(0.3)
        ph.figures.update(spike_bytes=mib * MIB, working_set_during=t.working_set(),
                          helper_held=held is not None)
        got = t.burst([t.prompts.text(256, 300 + i) for i in range(w.concurrency)], 8)
    finally:
        rc = helper.release()
    return _spike_verdict(t, ph, got, rc, f"{mib} MiB {kind} spike")


def phase_mmap_prefetch(t: Target, w: Workload) -> Phase:
    """A file larger than the limit mapped and read through while requests flow: page cache
    charged to the cgroup. It is reclaimable, so the kernel must drop it (fail count rises)
    rather than OOM-kill; requests get 200 or a 503 memory_trip, never a dead server."""
    ph = Phase("mmap_prefetch")
    if t.cgroup is None or w.mmap_path is None:
        ph.notes.append("skipped: no cgroup or no scratch file")
        ph.passed = True
        return ph
    drop_cached(w.mmap_path)  # cold again for this target: its reads are charged to it
    size = w.mmap_path.stat().st_size
    helper = Helper(t, "mmap", str(w.mmap_path))
    got: Counter = Counter()
    held = None
    try:
        if helper.expect("READY") is None:
            ph.notes.append(f"the prefetch helper did not start (exit {helper.proc.poll()})")
            return ph
        texts = [t.prompts.text(256, 400 + i) for i in range(w.concurrency)]
        with futures.ThreadPoolExecutor(1) as ex:
            during = ex.submit(t.burst, texts, 8)  # requests flow while the file is read
            helper.send("go")
            held = helper.expect("HELD", timeout_s=300)
            got += during.result()
        ws_held = t.working_set()
        got += t.burst(texts, 8)
    finally:
        rc = helper.release()
    ph.answers = dict(got)
    recovered = t.recovers()
    ph.figures = {"file_bytes": size, "helper_held": held is not None,
                  "working_set_while_mapped": ws_held if held else None,
                  "limit_bytes": t.lines()[1]}
    ph.notes.append(f"{size // MIB} MiB file mapped with MADV_WILLNEED and every page read "
                    f"(done: {held is not None}, helper exit {rc}); answers {dict(got)}; "
                    f"served again after: {recovered}")
    ph.passed = controlled(got) and recovered and rc == 0 and held is not None
    return ph


def weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def phase_load_spike(t: Target, w: Workload, env: dict | None = None) -> Phase:
    """The model loaded again (mlx-lm) beside the serving one, as many copies as take the
    working set halfway past the soft line; requests meanwhile must get 503 memory_trip."""
    ph = Phase("load_spike")
    if t.cgroup is None:
        ph.notes.append("skipped: the target has no cgroup of its own")
        ph.passed = True
        return ph
    wb = weights_bytes(w.model_dir)
    helper = Helper(t, "load", str(w.model_dir), env=env)
    got: Counter = Counter()
    try:
        if helper.expect("READY") is None:
            ph.notes.append(f"the load helper did not start (exit {helper.proc.poll()})")
            return ph
        if t.guarded:
            mib, ph.figures = _spike_mib(t)
            copies = (mib * MIB) // wb
            if copies < 1:
                ph.notes.append(f"skipped: one more copy ({wb // MIB} MiB) does not fit under "
                                "the hard line beside the worker; plimsoll never overlaps "
                                "loads (invariant 3), so this spike cannot happen to it")
                ph.passed = True
                return ph
            w.load_copies = int(min(copies, 256))
        else:
            ph.figures = {"working_set_before": t.working_set(), "limit_bytes": t.lines()[1]}
        copies = w.load_copies or 1
        texts = [t.prompts.text(256, 500 + i) for i in range(w.concurrency)]
        helper.send(str(copies))
        held = helper.expect("HELD", timeout_s=300)
        time.sleep(0.3)
        ph.figures.update(copies=copies, weights_bytes=wb, helper_held=held is not None,
                          loaded_bytes=int(held.split()[1]) if held else None,
                          working_set_during=t.working_set())
        got = t.burst(texts, 8)
    finally:
        rc = helper.release()
    return _spike_verdict(t, ph, got, rc, f"{copies} more load(s) of the {wb // MIB} MiB model")


def phase_together(t: Target, w: Workload, env: dict | None = None) -> Phase:
    """Several kinds at once: a numpy spike held while a file is prefetched, an overload
    burst and a full-context prefill are in flight."""
    ph = Phase("together")
    if t.cgroup is None:
        ph.notes.append("skipped: the target has no cgroup of its own")
        ph.passed = True
        return ph
    if w.mmap_path:
        drop_cached(w.mmap_path)  # cold: the prefetch is charged to this target again
    spike = Helper(t, "numpy", env=env)
    mapper = Helper(t, "mmap", str(w.mmap_path)) if w.mmap_path else None
    got: Counter = Counter()
    held = []
    try:
        ok = spike.expect("READY") and (mapper is None or mapper.expect("READY"))
        if not ok:
            ph.notes.append("a helper did not start")
            return ph
        if t.guarded:
            # a quarter of the way only: the prefill and the requests already in flight
            # grow the working set after it is measured, and the hard line must hold them
            mib, ph.figures = _spike_mib(t, 0.25)
            w.spike_mib["together"] = mib
        else:
            mib = w.spike_mib.get("together", 0)
            ph.figures = {"working_set_before": t.working_set(), "limit_bytes": t.lines()[1]}
        n = w.concurrency + w.max_queue + 4
        texts = [t.prompts.text(512, 600 + i) for i in range(n)]
        with futures.ThreadPoolExecutor(2) as ex:
            over = ex.submit(t.burst, texts, w.max_tokens)
            long = ex.submit(t.post, t.prompts.text(_fill(w), 601), w.default_max_tokens)
            spike.send(str(mib))
            held.append(spike.expect("HELD"))
            if mapper:
                mapper.send("go")
                held.append(mapper.expect("HELD", timeout_s=300))
            ph.figures["working_set_during"] = t.working_set()
            got += t.burst([t.prompts.text(256, 650 + i) for i in range(w.concurrency)], 8)
            got += over.result()
            got[long.result()] += 1
    finally:
        rcs = [spike.release(), *([mapper.release()] if mapper else [])]
    ph.answers = dict(got)
    recovered = t.recovers()
    ph.figures.update(spike_bytes=mib * MIB, helpers_held=all(held), helper_exits=rcs)
    ph.notes.append(f"{mib} MiB numpy spike + {'a file prefetch + ' if mapper else ''}"
                    f"{n} overload requests + one full-context prefill at once; "
                    f"{refused(got)} refused; helpers exit {rcs}; served again after: "
                    f"{recovered}")
    ph.passed = (controlled(got) and refused(got) >= 1 and recovered and all(held)
                 and all(rc == 0 for rc in rcs))
    return ph


def measured(kind: str, t: Target, w: Workload, env: dict | None, sampler,
             settle_s: float) -> Phase:
    """One fault kind on ``t`` with the sampler's figures for its window: the peak is reset
    first, and ``settle_s`` lets a late event (an OOM kill) land in the counters."""
    sampler.reset_peak()
    t0 = time.monotonic()
    ph = PHASES[kind](t, w, env)
    time.sleep(settle_s)
    ph.seconds = round(time.monotonic() - t0, 2)
    ph.figures.update(sampler.window(t0, time.monotonic(), kernel_peak=True))
    ph.target_alive = t.proc.poll() is None
    return ph


PHASES = {
    "first_inference": lambda t, w, env: phase_first_inference(t, w),
    "long_prefill": lambda t, w, env: phase_long_prefill(t, w),
    "overload": lambda t, w, env: phase_overload(t, w),
    "mlx_spike": lambda t, w, env: phase_spike(t, w, "mlx", env),
    "numpy_spike": lambda t, w, env: phase_spike(t, w, "numpy", env),
    "mmap_prefetch": lambda t, w, env: phase_mmap_prefetch(t, w),
    "load_spike": lambda t, w, env: phase_load_spike(t, w, env),
    "together": lambda t, w, env: phase_together(t, w, env),
}
FAULT_KINDS = tuple(PHASES)
