"""Greedy decode of 1 and 8 concurrent streams with and without speculation (prompt lookup,
or a draft model with ``--draft-model``), at controlled acceptance, through the HTTP API of a
real ``plimsoll worker``, beside ``mlx_lm.server`` with the same draft model.

Random weights give no realistic acceptance, so the acceptance is set by the model and
the prompt:

- ``repeat``: the tiny demo model as built (its greedy output settles into a loop, so
  lookup's drafts are right) and a prompt that repeats one sentence: high acceptance;
- ``random``: the same model with its matrices scaled by 4 (its greedy output varies from
  token to token, as ``plimsoll.engine.drive.sharpen``) and prompts of random words:
  lookup's few matches are wrong, each sequence's draft length falls to 0 and it retries one
  draft after 16 steps, then 32, 64 ... (each retry that accepts nothing doubles the wait):
  acceptance near 0.

For each regime every mode's server (``plain``; ``lookup``: ``--prompt-lookup 3
--num-draft-tokens K``) is started, then for each stream count (``--streams``, default 1,8)
warmed by one round and timed over ``--runs`` rounds, the modes interleaved (a shared
machine's drifting load hits each alike): a round sends its streams at once, each for
``--tokens`` output tokens, with new prompts every round (no server answers from a cached
prompt); ``tok_s`` is every stream's tokens over the first send to the last end, prefill
included. The speculating worker's status gives proposed / accepted.

``--draft-model`` measures the draft-model proposer instead, in one regime (``draft``: the
sharpened model and the random words): ``plain``; ``self-draft``, the model as its own draft
model (every draft right: acceptance ≈ 1, at the cost of a draft forward as large as the
model's for every drafted token); ``other-draft``, the same architecture built with another
seed and sharpened alike (its drafts are wrong: acceptance ≈ 0); and ``mlx_lm.server`` with
no draft, and with each draft model and ``--num-draft-tokens K`` (``--no-mlx-lm`` leaves
them out). ``--mtp DIR`` measures the MTP proposer on DIR, a checkpoint with an MTP layer
(``bench/gpu_model.py --mtp``: random, so its drafts are nearly all rejected), in one regime
(``mtp``: random words): ``plain`` (``--no-mtp``), ``mtp`` (the head, the worker's default)
and ``mlx_lm.server``, which drops the MTP layer: what the head costs at the adaptive draft
length. ``--before-code DIR`` runs each speculating plimsoll mode a second time on the
sources in DIR (``MODE before``), in the same interleaved rounds. ``--noise F,…`` adds
``lookup noise F`` modes, whose drafts are each made wrong with probability F
(``lib/draft_noise``): in ``repeat`` (drafts right) that sets the acceptance, the curve of
speed against acceptance; ``--lengths K,…`` adds ``lookup k=K`` modes (other draft lengths);
``--regimes`` picks the regimes (default both). Run with OpenBLAS::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
      PYTHONPATH=python python bench/speculative.py [--draft-model] \\
      --out-dir bench/results --name speculative-cpu-2026-12-01
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from lib import report, status
from lib.servers import OPENBLAS, ServerProcess, free_port, served_model, server_env
from lib.workloads import concurrent_streams

SENTENCE = "the quick brown fox jumps over the lazy dog and runs into the woods. "
WORDS = ["alpha", "delta", "orbit", "cinder", "mango", "quartz", "velvet", "ember", "harbor",
         "tundra", "pixel", "lumen", "saffron", "glacier", "nimbus", "zephyr"]


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
    for f in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        f.unlink()  # the shards and their index: one file of the scaled weights instead
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    return out


NOISE_HOOK = Path(__file__).resolve().parent / "lib" / "draft_noise"


class Server:
    """One mode's server: a plimsoll worker (``extra``: its speculation flags) or, with
    ``mlx_lm`` set, an ``mlx_lm.server`` (``extra``: ``--draft-model DIR`` and
    ``--num-draft-tokens K`` for its speculation); ``code``: the plimsoll sources it runs
    (PYTHONPATH; default this interpreter's)."""

    def __init__(self, model: Path, log: Path, extra: list[str], mlx_lm: bool = False,
                 code: Path | None = None, noise: float = 0.0, ceiling_gib: int = 16):
        port = free_port()
        self.url, self.mlx_lm = f"http://127.0.0.1:{port}", mlx_lm
        if mlx_lm:
            argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
                    "--host", "127.0.0.1", "--port", str(port), *extra]
        else:
            argv = [sys.executable, "-m", "plimsoll.cli", "worker", "--model", str(model),
                    "--model-name", "m", "--port", str(port), "--max-cache-blocks", "1024",
                    "--gpu-memory-utilization", "0.9", "--cache-memory-mb", "0",
                    "--max-num-seqs", "8", "--context", "2048", "--max-tokens", "512",
                    "--ceiling-bytes", str(ceiling_gib << 30),
                    "--total-ram-bytes", str(max(24, ceiling_gib + 8) << 30),
                    "--quiet", *extra]
        env = server_env(OPENBLAS)
        if code:  # first on the path, the rest kept (where the dependencies may be)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(code.resolve()), env.get("PYTHONPATH", "")) if p)
        if noise:  # lib/draft_noise: each draft wrong with probability ``noise``
            env["PLIMSOLL_BENCH_DRAFT_NOISE"] = str(noise)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(NOISE_HOOK), env.get("PYTHONPATH", "")) if p)
        self.server = ServerProcess("server", argv, env, port, log).start()
        self.server.wait_ready(300, paths=("/v1/models",) if mlx_lm
                               else ("/v1/plimsoll/status",))
        self.model = served_model(self.url, model) if mlx_lm else "m"

    def status(self) -> dict:
        if self.mlx_lm:
            return {}
        return httpx.get(self.url + "/v1/plimsoll/status", timeout=30).json()

    def streams(self, prompts: list[str], tokens: int) -> dict:
        """``prompts`` streamed at once (greedy): aggregate tok/s, all completion tokens over
        the first send to the last end."""
        bodies = [{"model": self.model, "prompt": p, "max_tokens": tokens, "temperature": 0,
                   **({} if self.mlx_lm else {"ignore_eos": True})} for p in prompts]
        r = concurrent_streams(self.url, bodies, 600, path="/v1/completions")
        if r.get("errors") or r.get("completed") != len(prompts):
            raise RuntimeError(f"{self.url}: {r.get('errors')}")
        return {"tok_s": r["aggregate_tps"], "tokens": r["completion_tokens"],
                "tokens_each_min": r["tokens_each_min"],
                "ttft_s": statistics.median(r["ttft_s"])}


def measure(model: Path, prompts: Callable[[int, int], list[str]],
            modes: dict[str, tuple], logs: Path, args, plans: dict) -> dict[str, dict]:
    """Every mode's server at once; for each stream count, their rounds interleaved (a
    shared machine's load drifts: each mode sees the same drift). Each round's prompts are
    new (``prompts(round, streams)``), so no server answers from a cached prompt. ``plans``
    gets each plimsoll server's attention plans as found before measuring."""
    servers: dict[str, Server] = {}
    out: dict[str, dict] = {}
    try:
        for mode, (extra, mlx_lm, *code) in modes.items():
            servers[mode] = Server(model, logs / f"{mode}.log", extra, mlx_lm, *code,
                                   ceiling_gib=args.ceiling_gib)
        for mode, srv in servers.items():  # a proposer that did not load measures nothing
            want = {"mtp": "mtp"}.get(mode.split()[0])
            got = srv.status().get("speculative", {}).get("proposer")
            if want and got != want:
                raise RuntimeError(f"{mode}: the worker's proposer is {got!r}, not {want!r} "
                                   f"(see {logs / (mode + '.log')})")
        for mode, srv in servers.items():  # no server's idle plan warmer beside a measurement
            if not srv.mlx_lm and args.wait_plans:
                plans[mode] = status.wait_plans(srv.url, "/v1/plimsoll/status",
                                                args.wait_plans)
                if plans[mode].get("built") is not None:
                    print(f"{mode}: attention plans {plans[mode]}", flush=True)
        for n in args.streams:
            before = {}
            for mode, srv in servers.items():
                srv.streams(prompts(-1 - n, n), 8)  # warm
                before[mode] = srv.status().get("speculative", {})
            runs: dict[str, list[dict]] = {mode: [] for mode in servers}
            for i in range(args.runs):
                batch = prompts(100 * n + i, n)
                for mode, srv in servers.items():
                    runs[mode].append(srv.streams(batch, args.tokens))
            for mode, srv in servers.items():
                spec = srv.status().get("speculative", {})
                out.setdefault(mode, {})[str(n)] = figures(runs[mode], before[mode], spec)
    finally:
        for srv in servers.values():
            srv.server.stop()
    return out


def figures(runs: list[dict], before: dict, spec: dict) -> dict:
    proposed = spec.get("proposed", 0) - before.get("proposed", 0)
    accepted = spec.get("accepted", 0) - before.get("accepted", 0)
    steps = spec.get("steps", 0) - before.get("steps", 0)
    rates = [r["tok_s"] for r in runs]
    return {"tok_s": statistics.median(rates), "tok_s_runs": rates,
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "tokens_each_min": min(r["tokens_each_min"] for r in runs),
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


def varied(salt: int, n: int) -> list[str]:
    """``n`` prompts of 60 random words (high-entropy text: lookup rarely matches)."""
    rng = random.Random(salt)
    return [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(n)]


def repeated(salt: int, n: int) -> list[str]:
    """``n`` prompts of one sentence six times, each after its own number."""
    return [f"{salt} {i}. " + SENTENCE * 6 for i in range(n)]


def markdown(result: dict) -> str:
    rows = []
    for regime, modes in result["regimes"].items():
        for n in map(str, result["streams"]):
            plain = modes["plain"][n]["tok_s"]
            own = modes.get("mlx_lm plain", {}).get(n, {}).get("tok_s")
            for mode, by in modes.items():
                m = by[n]
                base = own if mode.startswith("mlx_lm") and own else plain
                rows.append((regime, mode, n, report.num(m["tok_s"]),
                             f"{min(m['tok_s_runs']):.0f}–{max(m['tok_s_runs']):.0f}",
                             report.num(m["tok_s"] / plain, ".2f"),
                             report.num(m["tok_s"] / base, ".2f"),
                             m["proposed"], m["accepted"], report.num(m["acceptance"], ".2f")))
    eng = result["engine"]
    proposer = result.get("proposer")
    title = {"draft_model": "Draft-model", "mtp": "MTP-head"}.get(proposer, "Prompt-lookup")
    about = {"draft_model": DRAFT_ABOUT, "mtp": MTP_ABOUT}.get(proposer, LOOKUP_ABOUT)
    lines = [f"# {title} speculation, {' and '.join(map(str, result['streams']))} streams, "
             f"{result['machine']}", "",
             f"Command: `{result['command']}`", "", report.host_line(result["host"]), "",
             f"Model: {result.get('model_about', 'the tiny demo')} ({result['tokens']} greedy "
             "tokens per stream, "
             f"{result['runs']} runs, median of aggregate tok/s: every stream's tokens over the "
             f"first send to the last end, prefill included; k = {result['num_draft_tokens']}).",
             "", *report.table(("regime", "mode", "streams", "tok/s", "runs", "× plain",
                                "× its plain", "proposed", "accepted",
                                "acceptance"), rows), "",
             about, "",
             "`× its plain`: an mlx_lm.server row against mlx_lm.server without a draft model "
             "(a plimsoll row: against plimsoll's plain). `... before`: the same mode running "
             f"the code at {result.get('before_code') or '(none)'} (PYTHONPATH), the code "
             "before a change, in the same run.", "",
             "The engine alone (in process, interleaved, the `repeat` model at 100-560 "
             "tokens): a "
             f"decode step {eng['decode_step_ms']:.1f} ms, a step verifying 3 drafts (4 "
             f"tokens) {eng['verify4_step_ms']:.1f} ms ({eng['ratio']:.2f} x).", ""]
    return "\n".join(lines)


DRAFT_ABOUT = (
    "`draft`: the tiny demo with its matrices × 4 (varied greedy output) and random words (one "
    "prompt per stream). `self-draft`: the model as its own draft model (`--draft-model` = the "
    "model: every draft right, but each drafted token costs a draft forward as large as the "
    "model's, so this measures the mechanism, not a speed-up a small draft would give). "
    "`other-draft`: the same architecture built with another seed (its drafts are wrong). "
    "`mlx_lm ...`: `mlx_lm.server` with the same target, and the same draft model with "
    "`--num-draft-tokens` k (it serves one request at a time with a draft model). A shared "
    "2-core machine: compare each mode's runs column.")
MTP_ABOUT = (
    "`mtp`: random words to a checkpoint with a random MTP layer (bench/gpu_model.py --mtp), "
    "`plain` the same worker with `--no-mtp`. Random weights: the head's drafts are nearly "
    "all rejected, so each sequence falls to draft length 0 and retries one draft after 16, "
    "32, 64 ... steps; the row measures what the head costs then (target: no worse than "
    "0.95 x plain), not a speed-up. `mlx_lm plain`: mlx_lm.server on the same directory (it "
    "drops the MTP layer at load).")
LOOKUP_ABOUT = (
    "`repeat`: the model as built (random weights: its greedy output settles into a loop) and "
    "a repeated sentence (high acceptance). `random`: matrices × 4 (varied output) and random "
    "words (one prompt per stream): lookup rarely matches, and a sequence whose drafts find no "
    "match or are rejected falls to draft length 0; what remains is an unpipelined retry step "
    "after 16, 32, 64 ... steps. Compare each mode's runs column, not just medians.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=report.OUT / "speculative")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=lambda x: [int(v) for v in x.split(",")], default=[1, 8],
                    help="concurrent stream counts, comma-separated (default 1,8)")
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--wait-plans", type=float, default=120, metavar="S",
                    help="before measuring, wait up to S seconds for each plimsoll worker's "
                         "idle attention-plan warmer to finish (CUDA; it runs on the GPU "
                         "the other servers are measured on); 0: do not wait")
    ap.add_argument("--ceiling-gib", type=int, default=16,
                    help="each plimsoll worker's memory ceiling (default 16, this CPU box's; "
                         "a GPU host's 4B model as its own draft needs ~40)")
    ap.add_argument("--draft-model", action="store_true",
                    help="measure the draft-model proposer (the model as its own draft, and a "
                         "different-seed draft, beside mlx_lm.server's) instead of prompt lookup")
    ap.add_argument("--mtp", type=Path, default=None, metavar="DIR",
                    help="measure the MTP-head proposer on DIR (a checkpoint with an MTP "
                         "layer: bench/gpu_model.py --mtp) instead of prompt lookup")
    ap.add_argument("--no-mlx-lm", dest="mlx_lm", action="store_false",
                    help="leave out the mlx_lm.server rows of --draft-model and --mtp")
    ap.add_argument("--before-code", type=Path, default=None,
                    help="plimsoll sources (a python/ directory) of the code before a change: "
                         "each speculating mode also runs on them, as `MODE before`")
    ap.add_argument("--model", type=Path, default=None, metavar="DIR",
                    help="prompt lookup on DIR (e.g. bench/gpu_model.py's Qwen3-4B-shaped "
                         "model) instead of the tiny demo: `repeat` on DIR as built, `random` "
                         "on a sharpened copy under --dir, with mlx_lm.server on DIR beside them")
    ap.add_argument("--noise", type=lambda x: [float(v) for v in x.split(",")], default=[],
                    help="draft-noise fractions, comma-separated: a `lookup noise F` mode each "
                         "(every draft wrong with probability F: controlled acceptance)")
    ap.add_argument("--lengths", type=lambda x: [int(v) for v in x.split(",")], default=[],
                    help="more draft lengths, comma-separated: a `lookup k=K` mode each")
    ap.add_argument("--regimes", type=lambda x: x.split(","), default=["repeat", "random"],
                    help="the regimes to run, comma-separated (default repeat,random)")
    ap.add_argument("--out-dir", type=Path, default=report.RESULTS)
    ap.add_argument("--name", default=report.default_name("speculative"))
    args = ap.parse_args()
    import plimsoll
    from plimsoll.demo.model import build_demo_model

    if args.model is not None:
        base = args.model.resolve()
    else:
        base = build_demo_model(args.dir / "tiny", preset="tiny")
    # the sharpened copy only where a regime runs it (a copy of the whole model)
    sharp = sharpened(base, args.dir / f"{base.name}-sharp") \
        if "random" in args.regimes or args.draft_model else base
    regimes = {"repeat": (base, repeated), "random": (sharp, varied)}
    regimes = {r: regimes[r] for r in args.regimes}
    k = ["--num-draft-tokens", str(args.num_draft_tokens)]
    modes = {"plain": ([], False), "lookup": (["--prompt-lookup", "3", *k], False)}
    for f in args.noise:
        modes[f"lookup noise {f:g}"] = (["--prompt-lookup", "3", *k], False, None, f)
    for n in args.lengths:
        modes[f"lookup k={n}"] = (["--prompt-lookup", "3", "--num-draft-tokens", str(n)],
                                  False)
    if args.model is not None and args.mlx_lm:
        modes["mlx_lm plain"] = ([], True)
    if args.draft_model:
        other = sharpened(build_demo_model(args.dir / "tiny-seed1", preset="tiny", seed=1),
                          args.dir / "tiny-seed1-sharp")
        regimes = {"draft": regimes["random"]}
        modes = {"plain": ([], False), "self-draft": (["--draft-model", str(sharp), *k], False),
                 "other-draft": (["--draft-model", str(other), *k], False)}
        if args.mlx_lm:
            modes |= {"mlx_lm plain": ([], True),
                      "mlx_lm self-draft": (["--draft-model", str(sharp), *k], True),
                      "mlx_lm other-draft": (["--draft-model", str(other), *k], True)}
    if args.mtp is not None:
        regimes = {"mtp": (args.mtp.resolve(), varied)}
        modes = {"plain": (["--no-mtp"], False), "mtp": (["--mtp", *k], False)}
        if args.mlx_lm:
            modes["mlx_lm plain"] = ([], True)
    if args.before_code is not None:
        speculating = [m for m, (extra, mlx_lm, *_) in modes.items()
                       if extra and not mlx_lm and m != "plain"]
        modes |= {f"{m} before": (*modes[m][:2], args.before_code, *modes[m][3:])
                  for m in speculating}
    host = report.host_facts()
    out: dict = {}
    plans: dict = {}
    for regime, (model, prompts) in regimes.items():
        out[regime] = measure(model, prompts, modes, args.dir / regime, args,
                              plans.setdefault(regime, {}))
        for mode, by in out[regime].items():
            for n, m in by.items():
                print(f"{regime:7s} {mode:19s} {n:>2s} streams {m['tok_s']:8.1f} tok/s  "
                      f"accepted {m['accepted']}/{m['proposed']}", flush=True)
    engine = engine_steps(base)
    host["loadavg_end"] = report.loadavg()
    result = {"command": report.command(), "host": host, "engine": engine,
              "plimsoll_from": str(Path(plimsoll.__file__).parent),
              "machine": report.machine(), "tokens": args.tokens, "runs": args.runs,
              "streams": args.streams, "num_draft_tokens": args.num_draft_tokens,
              "regimes": out, "attention_plans": plans,
              "proposer": "mtp" if args.mtp else "draft_model" if args.draft_model
              else "prompt_lookup"}
    if args.mtp is not None:
        result["model_about"] = f"{args.mtp} (`bench/gpu_model.py --mtp`)"
    elif args.model is not None:
        result["model_about"] = f"{args.model} (`random`: its matrices x 4)"
    if args.before_code is not None:
        result["before_code"] = str(args.before_code)
    print(report.write(result, args.out_dir, args.name, markdown))


if __name__ == "__main__":
    main()
