"""Summary and markdown for bench/agentic.py: ratios candidate ÷ anchor, targets from issue 3.

Memory is printed in GB (10^9 bytes) everywhere in the report, as RSS figures usually are;
the JSON keeps raw bytes. Ratios compare the two servers at the last turn both completed,
so a server killed early (memory floor, crash) is compared on the turns it served.
"""

from __future__ import annotations

from harness_server import status_fields

TARGETS = {  # figure: (comparison, threshold) — issue 3, "Benchmark"
    "peak_over_needed": ("<=", 1.15),
    "turn_n_ttft": ("<=", 1.0),
    "decode_tps": (">=", 1.0),
    "aggregate_tps": (">=", 1.0),
}


def _ok_turns(server: dict) -> list[dict]:
    return [t for t in server.get("session", []) if not t.get("error")]


def _server_summary(server: dict, upto: int | None) -> dict:
    turns = [t for t in _ok_turns(server) if upto is None or t["turn"] <= upto]
    last = turns[-1] if turns else {}
    peak = max((t.get("peak_rss") or 0 for t in turns), default=0) or None
    needed = last.get("needed")
    decode = server.get("decode") or {}
    reported = status_fields(server["status_last"]) if server.get("status_last") else {}
    return {
        "turns_completed": len(_ok_turns(server)),
        "compared_turn": last.get("turn"),
        "prompt_tokens": last.get("prompt_tokens"),
        "needed": needed,
        "session_peak_rss": peak,
        "peak_over_needed": peak / needed if peak and needed else None,
        "turn_n_ttft": last.get("ttft_s"),
        "session_ttft_sum": sum(t.get("ttft_s") or 0 for t in turns) or None,
        "mlx_active_peak": max((t.get("mlx_active_peak") or 0 for t in turns), default=0)
        or None,
        "kv_bytes_held_end": last.get("kv_bytes_held_end"),
        "allocation_limit": reported.get("allocation_limit"),
        "kv_bytes_bound": reported.get("kv_bytes_bound"),
        "decode_tps": decode.get("decode_tps"),
        "decode_e2e_tps": decode.get("e2e_tps") or (
            decode.get("completion_tokens") / decode["total_s"]
            if decode.get("completion_tokens") and decode.get("total_s") else None),
        "decode_completion_tokens": decode.get("completion_tokens"),
        "decode_stopped_early": decode.get("stopped_early"),
        "decode_ignore_eos_accepted": decode.get("ignore_eos_sent"),
        "aggregate_tps": (server.get("concurrent") or {}).get("aggregate_tps"),
        "run_peak_rss": (server.get("peaks") or {}).get("rss"),
        "aborted": server.get("aborted"),
        "error": server.get("error"),
    }


def summarise(result: dict) -> dict:
    servers, weights = result["servers"], result["model"]["weights_bytes"]
    common = None
    if len(servers) == 2:
        common = min((len(_ok_turns(s)) for s in servers.values()), default=0) or None
    per = {label: _server_summary(s, common) for label, s in servers.items()}
    out: dict = {"servers": per, "compared_turn": common}
    if "anchor" in per and "candidate" in per:
        a, c = per["anchor"], per["candidate"]
        ratios = {k: (c[k] / a[k] if a.get(k) and c.get(k) is not None else None)
                  for k in ("session_peak_rss", "turn_n_ttft", "session_ttft_sum", "decode_tps",
                            "decode_e2e_tps", "aggregate_tps")}
        values = {"peak_over_needed": c["peak_over_needed"], **ratios}
        out["ratios"] = ratios
        out["targets"] = {k: {"value": values[k], "want": f"{op} {lim}",
                              "met": None if values[k] is None else
                              (values[k] <= lim if op == "<=" else values[k] >= lim)}
                          for k, (op, lim) in TARGETS.items()}
        # The admitted footprint is weights + reserve + pool; weights + the pool's KV bound
        # (``kv_bytes_bound``) is its lower bound, so this check errs on the strict side.
        bounds = {"peak_under_allocation_limit": c["allocation_limit"],
                  "peak_under_weights_plus_kv_bound":
                      c["kv_bytes_bound"] and weights + c["kv_bytes_bound"]}
        for name, bound in bounds.items():
            if bound and c["session_peak_rss"]:
                out["targets"][name] = {"value": c["session_peak_rss"] / bound,
                                        "want": "<= 1.0", "bound": bound,
                                        "met": c["session_peak_rss"] <= bound}
    return out


def _gb(x: float | None) -> str:
    return "–" if x is None else f"{x / 1e9:.2f}"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def markdown(result: dict) -> str:
    servers, summary, model, work = (result["servers"], result["summary"], result["model"],
                                     result["workload"])
    labels = list(servers)
    host = result["host"]
    lines = [
        f"# Serving benchmark — `{model['preset']}` preset",
        "",
        f"Command: `{result['command']}` (in `{result['cwd']}`), started {result['started']}.",
        "",
        f"Host: {host['cpus']} CPUs, {host['total_ram'] / 2**30:.1f} GiB RAM; Python "
        f"{host['python']}, mlx {host['mlx']}, mlx-lm {host['mlx_lm']}; servers started with "
        f"`LD_PRELOAD={host['ld_preload']}`.",
        "",
        f"Model: `{model['dir']}` ({model['model_type']}, {model['num_layers']} layers, "
        f"{model['kv_layers']} KV layers, {model['kv_dtype']}); weights "
        f"{_gb(model['weights_bytes'])} GB; KV {model['kv_bytes_per_token'] / 1024:.0f} KiB/token.",
        "",
        f"Workload: agentic session of {work['turns']} turns, each resending the conversation "
        f"plus ~{work['tool_tokens']} tokens of tool output (stdlib source, sha256 "
        f"{work['source_sha256'][:12]}), max_tokens {work['max_tokens']}, temperature 0, "
        f"streamed; single-stream decode of {work['decode_tokens']} tokens "
        f"(ignore_eos {'sent' if work['ignore_eos'] else 'not sent'}); {work['streams']} "
        f"concurrent streams of {work['stream_tokens']} tokens. Memory in GB = 10^9 bytes. "
        "\"Needed\" = weights + prompt tokens × KV bytes/token (one KV copy of the session).",
        "",
        "## Servers",
        "",
        "| | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
        "| command | " + " | ".join(f"`{' '.join(servers[k]['argv'])}`" for k in labels) + " |",
        "| ready (s) | " + " | ".join(_f(servers[k].get("ready_s"), ".1f") for k in labels) + " |",
        "| RSS after load (GB) | " + " | ".join(_gb(servers[k].get("rss_after_load"))
                                              for k in labels) + " |",
        "| warm-up request (s) / RSS after it (GB) | " + " | ".join(
            f"{_f((servers[k].get('warmup') or {}).get('s'), '.1f')} / "
            f"{_gb((servers[k].get('warmup') or {}).get('rss_after'))}" for k in labels) + " |",
        "| status endpoint | " + " | ".join(str(servers[k].get("status_supported")) for k in labels)
        + " |",
        "| stopped (rc, survivors) | " + " | ".join(
            f"{servers[k]['stop'].get('returncode')}, {servers[k]['stop'].get('survivors')}"
            for k in labels) + " |",
        "| load average at start / end | " + " | ".join(
            f"{servers[k]['loadavg_start'][0]:.2f} / {servers[k].get('loadavg_end', [0])[0]:.2f}"
            for k in labels) + " |",
        "| aborted / error | " + " | ".join(
            str(servers[k].get("aborted") or servers[k].get("error") or "–") for k in labels)
        + " |",
        "",
        "## Agentic session, per turn",
        "",
    ]
    lines += _turn_table(servers, labels)
    lines += ["", "## Summary", ""]
    lines += _summary_table(summary, labels)
    lines += ["", "Timings are single samples; turn-N TTFT swings with other load on the host "
              "(see the load averages above), the TTFT summed over all turns is steadier. "
              "Compare timings only within one run."]
    return "\n".join(lines) + "\n"


def _turn_table(servers: dict, labels: list[str]) -> list[str]:
    cols = ["cached", "TTFT s", "total s", "peak RSS GB", "RSS ÷ needed", "MLX active GB",
            "KV held GB"]
    head = "| turn | prompt tok | needed GB | " + " | ".join(
        f"{k[0].upper()} {c}" for k in labels for c in cols) + " |"
    rows = [head, "|" + "---|" * (3 + len(cols) * len(labels))]
    by_turn = {k: {t["turn"]: t for t in servers[k].get("session", [])} for k in labels}
    n = max((max(t, default=0) for t in by_turn.values()), default=0)
    for turn in range(1, n + 1):
        recs = [by_turn[k].get(turn, {}) for k in labels]
        prompts = sorted({r.get("prompt_tokens") for r in recs if r.get("prompt_tokens")})
        needed = next((r["needed"] for r in recs if r.get("needed")), None)
        cells = [str(turn), " / ".join(map(str, prompts)) or "–", _gb(needed)]
        for r in recs:
            if r.get("error"):
                cells += [f"error: {r['error'][:60]}"] + [""] * (len(cols) - 1)
                continue
            cells += [_f(r.get("cached_tokens"), "d") if r.get("cached_tokens") is not None
                      else "–", _f(r.get("ttft_s"), ".3f"), _f(r.get("total_s"), ".3f"),
                      _gb(r.get("peak_rss")), _f(r.get("rss_over_needed")),
                      _gb(r.get("mlx_active_peak")), _gb(r.get("kv_bytes_held_end"))]
        rows.append("| " + " | ".join(cells) + " |")
    key = ", ".join(f"{k[0].upper()} = {k}" for k in labels)
    rows += ["", f"{key}. MLX active is the peak the server's status endpoint reported during "
             "the turn (– where it has none); KV held is `kv_bytes_held` after the turn."]
    return rows


def _summary_table(summary: dict, labels: list[str]) -> list[str]:
    per, ratios, targets = summary["servers"], summary.get("ratios", {}), summary.get("targets",
                                                                                     {})
    both = "anchor" in per and "candidate" in per
    head = "| figure | " + " | ".join(labels) + (" | candidate ÷ anchor | target | met |"
                                                  if both else " |")
    rows = [head, "|---|" + "---|" * (len(labels) + (3 if both else 0))]

    def row(name: str, key: str, fmt, ratio_key: str | None = None,
            target_key: str | None = None) -> None:
        cells = [name] + [fmt(per[k].get(key)) for k in labels]
        if both:
            t = targets.get(target_key or "", {})
            cells += [_f(ratios.get(ratio_key)) if ratio_key else "–",
                      t.get("want", "–"), {True: "yes", False: "**no**"}.get(t.get("met"), "–")]
        rows.append("| " + " | ".join(cells) + " |")

    row("turns completed", "turns_completed", str)
    row("compared turn (N)", "compared_turn", str)
    row("prompt tokens at turn N", "prompt_tokens", str)
    row("needed at turn N (GB)", "needed", _gb)
    row("session peak RSS (GB)", "session_peak_rss", _gb, "session_peak_rss")
    row("session peak RSS ÷ needed", "peak_over_needed", _f, None, "peak_over_needed")
    row("session peak MLX active (GB)", "mlx_active_peak", _gb)
    row("KV held after turn N (GB)", "kv_bytes_held_end", _gb)
    row("turn-N TTFT (s)", "turn_n_ttft", lambda x: _f(x, ".3f"), "turn_n_ttft", "turn_n_ttft")
    row("TTFT summed over turns 1..N (s)", "session_ttft_sum", lambda x: _f(x, ".1f"),
        "session_ttft_sum")
    row("decode tok/s (1 stream)", "decode_tps", _f, "decode_tps", "decode_tps")
    row("decode tok/s end to end (TTFT included)", "decode_e2e_tps", _f, "decode_e2e_tps")
    row("decode completion tokens", "decode_completion_tokens", str)
    row("ignore_eos sent and not refused", "decode_ignore_eos_accepted", str)
    row("aggregate tok/s (N streams)", "aggregate_tps", _f, "aggregate_tps", "aggregate_tps")
    row("whole-run peak RSS (GB)", "run_peak_rss", _gb)
    for key, name in (("peak_under_allocation_limit", "allocation limit"),
                      ("peak_under_weights_plus_kv_bound", "(weights + KV pool bound)")):
        if key in targets:
            t = targets[key]
            rows.append(f"| candidate session peak ÷ {name} | | {_f(t['value'])} "
                        f"({_gb(t['bound'])} GB) | | {t['want']} | "
                        f"{'yes' if t['met'] else '**no**'} |")
    return rows
