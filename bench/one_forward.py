"""One engine step that mixes 4 decodes and a 256-token chunk at a prefix offset, in process.

By hand, not a test. Standalone: builds a demo model (``--preset``, default ``tiny``) into
``--dir`` unless one is there (``--layers N``: the preset's widths with N layers, random
weights of its own, the preset's tokenizer), loads :class:`plimsoll.engine.Engine`, prefills
four sequences (300-460 tokens) and a fifth one's 512-token prefix, then times ``--steps``
steps that each decode the four (one token each, explicit tokens, positions advancing) while
the fifth writes a 256-token chunk at position 512 that samples (the tail of a prompt whose
prefix is cached). Per step:

- ``build_ms``: the engine's own host time in :meth:`Engine.run_async`, the graph built
  (its time inside ``mx.async_eval`` left out: on the CPU backend that call blocks while the
  queue is full, so it is compute, not host work);
- ``host_ms``: :meth:`Engine.run_async` returning (the graph built and submitted);
- ``total_ms``: run_async + ``result()`` + ``mx.synchronize()`` (everything computed);
- ``cpu_ms``: the process's CPU time over the same span (every thread: less sensitive to
  neighbours on a shared machine than the wall clock);
- ``forwards``: calls of the model's ``__call__`` in the step (a wrapper on its class).

Steps are interleaved with nothing else; medians and the spread are reported. Run with
OpenBLAS on a Linux CPU::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      PYTHONPATH=python python bench/one_forward.py --label after \\
      --json bench/results/one-forward-cpu-2026-12-01.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import mlx.core as mx
from plimsoll.demo.model import build_demo_model
from plimsoll.engine import Engine
from plimsoll.engine.work import Step, Work

BLOCK = 16
DECODES = (300, 350, 400, 460)  # the four decoding sequences' prompt lengths
PREFIX, CHUNK = 512, 256


def _deeper(base: Path, layers: int) -> Path:
    """``base``'s architecture with ``layers`` decoder layers (random weights)."""
    import mlx_lm.utils as mlu

    out = base.parent / f"{base.name}-{layers}L"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((base / "config.json").read_text())
    config["num_hidden_layers"] = layers
    model_class, args_class = mlu._get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    mlu.save_model(out, model)
    mlu.save_config(config, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        shutil.copy(base / name, out / name)
    return out


def _tokens(n: int, salt: int) -> tuple[int, ...]:
    return tuple((7 * i + 13 * salt) % 400 + 20 for i in range(n))


def _count_forwards(model) -> list[int]:
    cls = type(model)
    calls = [0]
    original = cls.__call__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    cls.__call__ = counted
    return calls


def _time_async_eval() -> list[float]:
    """Seconds spent inside ``mx.async_eval`` (the engine's submission, which blocks on the
    CPU backend while its queue is full), accumulated into the returned list's one item."""
    spent = [0.0]
    original = mx.async_eval

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    mx.async_eval = timed
    return spent


def measure(eng: Engine, steps: int) -> dict:
    tables, at = [], 0
    for n in (*DECODES, PREFIX + CHUNK):
        need = -(-(n + steps + 2) // BLOCK)
        tables.append(tuple(range(at, at + need)))
        at += need
    for i, n in enumerate(DECODES):
        eng.run(Step(prefills=(Work(i, _tokens(n, i), 0, tables[i], True),)))
    last = len(DECODES)
    eng.run(Step(prefills=(Work(last, _tokens(PREFIX, last), 0, tables[last], False),)))
    mx.synchronize()
    calls = _count_forwards(eng.model)
    spent = _time_async_eval()
    host, build, total, cpu, forwards = [], [], [], [], []
    chunk = _tokens(CHUNK, 99)
    for k in range(steps + 1):
        decodes = tuple(Work(i, (5 + k,), n + k, tables[i], True) for i, n in enumerate(DECODES))
        step = Step(decodes=decodes,
                    prefills=(Work(last, chunk, PREFIX, tables[last], True),))
        calls[0], spent[0] = 0, 0.0
        c0 = time.process_time()
        t0 = time.perf_counter()
        pending = eng.run_async(step)
        t1 = time.perf_counter()
        built = t1 - t0 - spent[0]
        pending.result()
        mx.synchronize()
        t2 = time.perf_counter()
        c2 = time.process_time()
        if k:  # the first step is a warm-up
            host.append((t1 - t0) * 1e3)
            build.append(built * 1e3)
            total.append((t2 - t0) * 1e3)
            cpu.append((c2 - c0) * 1e3)
            forwards.append(calls[0])
    return {"build_ms_median": statistics.median(build), "build_ms_min": min(build),
            "host_ms_median": statistics.median(host), "host_ms_min": min(host),
            "host_ms_max": max(host), "total_ms_median": statistics.median(total),
            "total_ms_min": min(total), "total_ms_max": max(total),
            "cpu_ms_median": statistics.median(cpu), "cpu_ms_min": min(cpu),
            "forwards_per_step": sorted(set(forwards)), "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dir", default="/tmp/one-forward-model")
    ap.add_argument("--layers", type=int, help="the preset's widths with this many layers")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--label", required=True, help="e.g. before / after")
    ap.add_argument("--json", help="append the result under --label to this JSON file")
    ap.add_argument("--commit", help="the engine's commit, when PYTHONPATH points at another "
                                     "checkout than this one (default: this one's HEAD)")
    args = ap.parse_args()
    path = build_demo_model(Path(args.dir) / args.preset, args.preset)
    if args.layers:
        path = _deeper(path, args.layers)
    eng = Engine.load(path, block_tokens=BLOCK, max_blocks=512)
    preset = args.preset + (f"-{args.layers}L" if args.layers else "")
    result = {"label": args.label, "preset": preset, "device": str(mx.default_device()),
              "mlx": mx.__version__, "machine": f"{platform.machine()} {platform.system()}",
              "commit": args.commit or subprocess.run(
                  ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                  text=True).stdout.strip(),
              "decodes": list(DECODES), "chunk": CHUNK, "chunk_start": PREFIX,
              **measure(eng, args.steps)}
    print(json.dumps(result))
    if args.json:
        out = Path(args.json)
        data = json.loads(out.read_text()) if out.exists() else {}
        data.setdefault(preset, {})[args.label] = result
        out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
