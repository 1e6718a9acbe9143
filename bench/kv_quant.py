"""Quantized KV, by hand: the agentic session at the model's dtype, q8 and q4, beside mlx_lm.server.

Issue 15 ("What to build" item 3). One run, one workload (bench/agentic.py's: the agentic
session, single-stream decode, concurrent streams), servers one after the other, never
together:

1. ``mlx_lm.server`` with its defaults (the anchor: it has no batched quantized KV — its
   ``--kv-bits`` turns batching off — so it runs at the model's dtype);
2. ``plimsoll launch … --kv-dtype auto`` (the model's dtype), then ``q8``, then ``q4``.

Per server: KV bytes held after the last turn (plimsoll's ``kv_bytes_held``), peak RSS of the
session, MLX active memory peak, the last turn's TTFT and the sum over turns, decode tok/s
(TTFT excluded) and aggregate tok/s of the concurrent streams. Ratios: each plimsoll run ÷
mlx_lm.server, and q8 / q4 ÷ plimsoll at the model's dtype. Writes
``<out-dir>/kv-quant-<tag>.{json,md}``.

    python bench/kv_quant.py --model /tmp/kvq-models/qwen3-0.6b --tag cpu
    python bench/kv_quant.py --model /tmp/qwen3-4b-shaped --tag h200 --preload ''   # GPU

``--kv auto,q8`` picks the plimsoll runs, ``--launch-args "--concurrency 8 --context 40960"``
sets launch's sizing (default ``--concurrency 8 --context 8192 --max-tokens 256``); the other
flags are bench/agentic.py's (``--turns``, ``--tool-tokens``, ``--decode-tokens``,
``--streams``, ``--stream-tokens``, ``--preload``, ...).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from importlib.metadata import version
from pathlib import Path

import psutil
from agentic import ANCHOR, build_workload, parse_args, run_server, wait_for_memory
from harness_report import _server_summary
from plimsoll.core.model_facts import inspect_model

KV = ("auto", "q8", "q4")
CANDIDATE = "{python} -m plimsoll.cli launch {model} --host {host} --port {port} %s --kv-dtype %s"
LAUNCH_ARGS = "--concurrency 8 --context 8192 --max-tokens 256"
FIGURES = [  # (key, label, scale, unit)
    ("kv_bytes_held_end", "KV bytes held after the last turn", 1e6, "MB"),
    ("session_peak_rss", "session peak RSS", 1e9, "GB"),
    ("mlx_active_peak", "session MLX active peak", 1e9, "GB"),
    ("turn_n_ttft", "last turn TTFT", 1, "s"),
    ("session_ttft_sum", "sum of TTFTs", 1, "s"),
    ("decode_tps", "1-stream decode", 1, "tok/s"),
    ("aggregate_tps", "concurrent streams, aggregate", 1, "tok/s"),
]


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def summarise(servers: dict) -> dict:
    upto = min((len([t for t in s.get("session", []) if not t.get("error")])
                for s in servers.values()), default=0) or None
    rows = {label: _server_summary(s, upto) for label, s in servers.items()}
    anchor, base = rows.get("mlx_lm.server", {}), rows.get("plimsoll-auto", {})
    out = {"compared_turn": upto, "servers": rows, "vs_anchor": {}, "vs_model_dtype": {}}
    for label, row in rows.items():
        if label == "mlx_lm.server":
            continue
        out["vs_anchor"][label] = {k: _ratio(row.get(k), anchor.get(k)) for k, *_ in FIGURES}
        if label != "plimsoll-auto":
            out["vs_model_dtype"][label] = {k: _ratio(row.get(k), base.get(k))
                                            for k, *_ in FIGURES}
    return out


def _fmt(v, scale):
    return "—" if v is None else f"{v / scale:.3g}"


def markdown(result: dict) -> str:
    s = result["summary"]
    labels = list(s["servers"])
    lines = [(f"# Quantized KV, the agentic session ({result['model']['preset']}, "
             f"{result['model']['kv_dtype']} weights/activations)"), "",
             f"Command: `{result['command']}`", "",
             (f"Host: {result['host']['cpus']} CPUs, mlx {result['host']['mlx']}, mlx-lm "
             f"{result['host']['mlx_lm']}; started {result['started']}. Workload: "
             f"{result['workload']['turns']} turns (+{result['workload']['tool_tokens']} tool "
             f"tokens each), compared at turn {s['compared_turn']}; decode "
             f"{result['workload']['decode_tokens']} tokens; {result['workload']['streams']} "
             f"streams × {result['workload']['stream_tokens']}."), "",
             "| figure | " + " | ".join(labels) + " |",
             "|---|" + "---|" * len(labels)]
    for key, name, scale, unit in FIGURES:
        lines.append(f"| {name} ({unit}) | " + " | ".join(
            _fmt(s["servers"][lb].get(key), scale) for lb in labels) + " |")
    for title, table in (("÷ mlx_lm.server (same run)", s["vs_anchor"]),
                         ("÷ plimsoll at the model's dtype", s["vs_model_dtype"])):
        cols = list(table)
        lines += ["", f"Ratios {title}:", "", "| figure | " + " | ".join(cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for key, name, *_ in FIGURES:
            lines.append(f"| {name} | " + " | ".join(
                "—" if table[c].get(key) is None else f"{table[c][key]:.3f}" for c in cols)
                + " |")
    errors = {lb: r["error"] for lb, r in s["servers"].items() if r.get("error")}
    if errors:
        lines += ["", "Errors: " + "; ".join(f"{k}: {v}" for k, v in errors.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tag = "cpu"
    if "--tag" in argv:
        i = argv.index("--tag")
        tag = argv[i + 1]
        del argv[i:i + 2]
    launch_args = LAUNCH_ARGS
    if "--launch-args" in argv:  # plimsoll launch's sizing flags (default: LAUNCH_ARGS)
        i = argv.index("--launch-args")
        launch_args = argv[i + 1]
        del argv[i:i + 2]
    kvs = KV
    if "--kv" in argv:  # e.g. --kv auto,q8 (default all three)
        i = argv.index("--kv")
        kvs = tuple(argv[i + 1].split(","))
        del argv[i:i + 2]
    args = parse_args(argv)
    args.model = args.model.resolve()
    facts = {kv: inspect_model(args.model, kv_dtype=None if kv == "auto" else kv) for kv in KV}
    meta = args.model / "demo-model.json"
    preset = json.loads(meta.read_text()).get("preset") if meta.exists() else args.model.name
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    work = build_workload(args)
    plan = [("mlx_lm.server", args.anchor_cmd if args.anchor_cmd != ANCHOR else ANCHOR, "auto")]
    plan += [(f"plimsoll-{kv}", CANDIDATE % (launch_args, kv), kv) for kv in kvs]
    if args.only == "candidate":
        plan = plan[1:]
    servers: dict[str, dict] = {}
    baseline = psutil.virtual_memory().available
    for label, template, kv in plan:
        if servers:
            wait_for_memory(baseline - 512 * 1024**2)
        servers[label] = run_server(label, template, args, work, facts[kv])
    result = {
        "command": shlex.join([sys.executable, *sys.argv]), "cwd": os.getcwd(),
        "started": started,
        "host": {"cpus": os.cpu_count(), "total_ram": psutil.virtual_memory().total,
                 "python": sys.version.split()[0], "mlx": version("mlx"),
                 "mlx_lm": version("mlx-lm"), "ld_preload": args.preload},
        "model": {"dir": str(args.model), "preset": preset, **facts["auto"].model_dump()},
        "kv_bytes_per_token": {kv: f.kv_bytes_per_token for kv, f in facts.items()},
        "workload": {"turns": args.turns, "tool_tokens": args.tool_tokens,
                     "max_tokens": args.max_tokens, "decode_tokens": args.decode_tokens,
                     "streams": args.streams, "stream_tokens": args.stream_tokens,
                     "repeats": args.repeats, "source_sha256": work["source_sha256"]},
        "servers": servers,
    }
    result["summary"] = summarise(servers)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = args.out_dir / f"kv-quant-{tag}"
    Path(f"{base}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    Path(f"{base}.md").write_text(markdown(result))
    print(f"wrote {base}.json and {base}.md")
    return 0 if all(not s.get("error") for s in servers.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
