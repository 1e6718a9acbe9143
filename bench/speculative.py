"""Single-stream greedy decode with and without speculation (prompt lookup, or a draft model
with ``--draft-model``), at controlled acceptance, through the HTTP API of a real
``plimsoll worker``.

Random weights give no realistic acceptance, so the acceptance is set by the model and
the prompt:

- ``repeat``: the tiny demo model as built (its greedy output settles into a loop, so
  lookup's drafts are right) and a prompt that repeats one sentence: high acceptance;
- ``random``: the same model with its matrices scaled by 4 (its greedy output varies from
  token to token, as ``plimsoll.engine.drive.sharpen``) and a prompt of random words:
  lookup's few matches are wrong, each sequence's draft length falls to 0 and it retries one
  draft after 16 steps, then 32, 64 ... (each retry that accepts nothing doubles the wait):
  acceptance near 0.

For each regime both modes' workers (``plain``; ``lookup``: ``--prompt-lookup 3
--num-draft-tokens K``) are started and warmed by one request, then ``--runs`` rounds of one
streamed request to each (interleaved, so a shared machine's drifting load hits both) of
``--tokens`` output tokens are timed: ``tok_s`` is tokens / (the last token's arrival - the
request's start); the prompt is short, so its prefill is a small part (a speculating
stream's tokens come in bursts, so first-to-last token time would overstate it). The
speculating worker's status gives proposed / accepted.

``--draft-model`` measures the draft-model proposer instead, in one regime (``draft``: the
sharpened model and the random words): ``plain``; ``self-draft``, the model as its own draft
model (every draft right: acceptance ≈ 1, at the cost of a draft forward as large as the
model's for every drafted token); ``other-draft``, the same architecture built with another
seed and sharpened alike (its drafts are wrong: acceptance ≈ 0, each sequence's draft length
falls to 0). Run with OpenBLAS::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      PYTHONPATH=python python bench/speculative.py [--draft-model] \\
      --out-dir bench/results --name speculative-cpu-2026-12-01
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx

from lib import report
from lib.servers import OPENBLAS, ServerProcess, free_port, server_env

SENTENCE = "the quick brown fox jumps over the lazy dog and runs into the woods. "


def sharpened(base: Path, out: Path, scale: float = 4.0) -> Path:
    """A copy of ``base`` with its 2-D matrices scaled by ``scale``."""
    if (out / "model.safetensors").exists():
        return out
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from plimsoll.engine.drive import sharpen

    shutil.copytree(base, out, dirs_exist_ok=True)
    model, _ = mlx_lm.load(str(base))
    sharpen(model, scale)
    for f in out.glob("*.safetensors"):
        f.unlink()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    return out


class Worker:
    def __init__(self, model: Path, log: Path, extra: list[str]):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "plimsoll.cli", "worker", "--model", str(model),
                "--model-name", "m", "--port", str(port), "--max-cache-blocks", "1024",
                "--gpu-memory-utilization", "0.9", "--cache-memory-mb", "0",
                "--max-num-seqs", "1", "--context", "2048", "--max-tokens", "512",
                "--ceiling-bytes", str(16 << 30), "--total-ram-bytes", str(24 << 30),
                "--quiet", *extra]
        self.server = ServerProcess("worker", argv, server_env(OPENBLAS), port, log).start()
        self.server.wait_ready(300, paths=("/v1/plimsoll/status",))

    def status(self) -> dict:
        return httpx.get(self.url + "/v1/plimsoll/status", timeout=30).json()

    def stream(self, prompt: str, tokens: int) -> dict:
        """One streamed greedy completion: its token times."""
        times: list[float] = []
        t0 = time.perf_counter()
        body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if (line.startswith("data: ") and line != "data: [DONE]"
                        and json.loads(line[6:])["choices"]):
                    times.append(time.perf_counter())
        first, last = times[0], times[-1]
        return {"ttft_s": first - t0, "events": len(times), "tok_s": tokens / (last - t0)}


def measure(model: Path, prompt: str, modes: dict[str, list[str]], logs: Path,
            args) -> dict[str, dict]:
    """Every mode's worker at once, their requests interleaved (a shared machine's load
    drifts: each mode sees the same drift)."""
    workers: dict[str, Worker] = {}
    try:
        for mode, extra in modes.items():
            workers[mode] = Worker(model, logs / f"{mode}.log", extra)
        before = {}
        for mode, w in workers.items():
            w.stream(prompt, 8)  # warm
            before[mode] = w.status().get("speculative", {})
        runs: dict[str, list[dict]] = {mode: [] for mode in workers}
        for _ in range(args.runs):
            for mode, w in workers.items():
                runs[mode].append(w.stream(prompt, args.tokens))
        after = {mode: w.status().get("speculative", {}) for mode, w in workers.items()}
    finally:
        for w in workers.values():
            w.server.stop()
    return {mode: figures(runs[mode], before[mode], after[mode]) for mode in workers}


def figures(runs: list[dict], before: dict, spec: dict) -> dict:
    proposed = spec.get("proposed", 0) - before.get("proposed", 0)
    accepted = spec.get("accepted", 0) - before.get("accepted", 0)
    steps = spec.get("steps", 0) - before.get("steps", 0)
    rates = [r["tok_s"] for r in runs]
    return {"tok_s": statistics.median(rates), "tok_s_runs": rates,
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "proposed": proposed, "accepted": accepted, "verify_steps": steps,
            "acceptance": accepted / proposed if proposed else None,
            "speculative": spec}


def engine_steps(model: Path, steps: int = 60) -> dict:
    """In process, interleaved: one sequence's decode step against a verifying step of 3
    drafts (4 tokens) at advancing positions: what the mechanism costs without the worker's
    loop and HTTP."""
    from plimsoll.engine import Engine
    from plimsoll.engine.work import Step, Work

    eng = Engine.load(model, block_tokens=16, max_blocks=128)
    prompt = tuple(range(5, 105))
    ta, tb = tuple(range(0, 40)), tuple(range(40, 80))
    eng.run(Step(prefills=(Work(1, prompt, 0, ta, True), Work(2, prompt, 0, tb, True))))
    pa = pb = len(prompt)
    decode, verify = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.run(Step(decodes=(Work(1, (7,), pa, ta, True),)))
        t1 = time.perf_counter()
        eng.run(Step(prefills=(Work(2, (7,) * 4, pb, tb, True, draft=3),)))
        t2 = time.perf_counter()
        decode.append(t1 - t0)
        verify.append(t2 - t1)
        pa, pb = pa + 1, pb + 4
        if pb > 560:
            pa = pb = len(prompt)
    d, v = statistics.median(decode) * 1e3, statistics.median(verify) * 1e3
    return {"decode_step_ms": d, "verify4_step_ms": v, "ratio": v / d}


def markdown(result: dict) -> str:
    rows = []
    for regime, modes in result["regimes"].items():
        plain = modes["plain"]["tok_s"]
        for mode, m in modes.items():
            rows.append((regime, mode, report.num(m["tok_s"]),
                         f"{min(m['tok_s_runs']):.0f}–{max(m['tok_s_runs']):.0f}",
                         report.num(m["tok_s"] / plain, ".2f"),
                         m["proposed"], m["accepted"], report.num(m["acceptance"], ".2f")))
    eng = result["engine"]
    draft = result.get("proposer") == "draft_model"
    title = "Draft-model" if draft else "Prompt-lookup"
    about = ("`draft`: the tiny demo with its matrices × 4 (varied greedy output) and random "
             "words. `self-draft`: the model as its own draft model (`--draft-model` = the "
             "model: every draft right, but each drafted token costs a draft forward as large "
             "as the model's, so this measures the mechanism, not a speed-up a small draft "
             "would give). `other-draft`: the same architecture built with another seed (its "
             "drafts are wrong: each sequence's draft length falls to 0 in 3 steps, then it "
             "retries after 16, 32, 64 ... steps). Each retry costs a draft prefill of the "
             "tokens it missed "
             "and an unpipelined verifying step: on this CPU a chunk of 16 or more tokens of "
             "the tiny model takes 2-4 decode steps' time (a draft as large as the model), so the "
             "retries cost more here than a small draft on a GPU would. A shared 2-core "
             "machine: compare each mode's runs column."
             if draft else
             "`repeat`: the demo model's looping greedy output and a repeated sentence (high "
             "acceptance). `random`: matrices × 4 (varied output) and random words: lookup "
             "rarely matches, and a sequence whose drafts find no match or are rejected falls "
             "to draft length 0 in 3 steps; what remains is an unpipelined retry step after "
             "16, 32, 64 ... steps. A shared 2-core machine: compare each mode's runs column, "
             "not just medians.")
    lines = [f"# {title} speculation, 1 stream, {result['machine']}", "",
             f"Command: `{result['command']}`", "", report.host_line(result["host"]), "",
             f"Model: the tiny demo ({result['tokens']} greedy tokens per request, "
             f"{result['runs']} runs, median; k = {result['num_draft_tokens']}).", "",
             *report.table(("regime", "mode", "tok/s", "runs", "× plain", "proposed",
                            "accepted", "acceptance"), rows), "",
             about, "",
             "The engine alone (in process, interleaved, the tiny model at 100-560 tokens): a "
             f"decode step {eng['decode_step_ms']:.1f} ms, a step verifying 3 drafts (4 "
             f"tokens) {eng['verify4_step_ms']:.1f} ms ({eng['ratio']:.2f} x).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=report.OUT / "speculative")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--draft-model", action="store_true",
                    help="measure the draft-model proposer (the model as its own draft, and a "
                         "different-seed draft) instead of prompt lookup")
    ap.add_argument("--out-dir", type=Path, default=report.RESULTS)
    ap.add_argument("--name", default=report.default_name("speculative"))
    args = ap.parse_args()
    from plimsoll.demo.model import build_demo_model

    base = build_demo_model(args.dir / "tiny", preset="tiny")
    sharp = sharpened(base, args.dir / "tiny-sharp")
    rng = random.Random(0)
    words = ["alpha", "delta", "orbit", "cinder", "mango", "quartz", "velvet", "ember",
             "harbor", "tundra", "pixel", "lumen", "saffron", "glacier", "nimbus", "zephyr"]
    regimes = {"repeat": (base, SENTENCE * 6),
               "random": (sharp, " ".join(rng.choice(words) for _ in range(60)))}
    k = ["--num-draft-tokens", str(args.num_draft_tokens)]
    modes = {"plain": [], "lookup": ["--prompt-lookup", "3", *k]}
    if args.draft_model:
        other = sharpened(build_demo_model(args.dir / "tiny-seed1", preset="tiny", seed=1),
                          args.dir / "tiny-seed1-sharp")
        regimes = {"draft": regimes["random"]}
        modes = {"plain": [], "self-draft": ["--draft-model", str(sharp), *k],
                 "other-draft": ["--draft-model", str(other), *k]}
    host = report.host_facts()
    out: dict = {}
    for regime, (model, prompt) in regimes.items():
        out[regime] = measure(model, prompt, modes, args.dir / regime, args)
        for mode, m in out[regime].items():
            print(f"{regime:7s} {mode:11s} {m['tok_s']:8.1f} tok/s  "
                  f"accepted {m['accepted']}/{m['proposed']}", flush=True)
    engine = engine_steps(base)
    host["loadavg_end"] = report.loadavg()
    result = {"command": report.command(), "host": host, "engine": engine,
              "machine": report.machine(), "tokens": args.tokens, "runs": args.runs,
              "num_draft_tokens": args.num_draft_tokens, "regimes": out,
              "proposer": "draft_model" if args.draft_model else "prompt_lookup"}
    print(report.write(result, args.out_dir, args.name, markdown))


if __name__ == "__main__":
    main()
