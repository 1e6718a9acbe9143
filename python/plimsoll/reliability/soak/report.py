"""The soak's report: per-target figures from the records, the verdict, JSON and Markdown.

plimsoll passes when, under the bound, it had 0 OOM kills (its cgroup and every worker's),
never exited, answered the first request after the load stopped (no wedge), and every
request it did not serve was refused with a code (429/503 with a reason, or a 400 naming a
limit) — never a 5xx without one, never a broken connection. ``mlx_lm.server`` is recorded,
not judged: what stops it is the kernel.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from plimsoll.core.units import MIB


def summarize(target: dict) -> dict:
    """The target's figures with its records counted (the records themselves dropped)."""
    if not target.get("ran"):
        return target
    recs = target["records"]
    out = {k: v for k, v in target.items() if k != "records"}
    by_status = Counter(str(r["status"]) for r in recs)
    refusals = Counter(f"{r['status']} {r['code'] or '(no code)'}" for r in recs
                       if r["status"] != 200 and not str(r["status"]).startswith("transport"))
    mid_stream = Counter(r["code"] for r in recs if r["status"] == 200 and r["code"])
    words = [r["words"] for r in recs]
    out["requests"] = {
        "total": len(recs), "served": sum(1 for r in recs if r["status"] == 200
                                          and not r["code"]),
        "cancelled_mid_stream": sum(1 for r in recs if r["cancelled"]),
        "streamed": sum(1 for r in recs if r["stream"]),
        "other_model": sum(1 for r in recs if r["model"] == target["models"][1]),
        "session_turns": sum(1 for r in recs if r["kind"] == "turn"),
        "churn": sum(1 for r in recs if r["kind"] == "churn"),
        "largest_prompt_words": max(words) if words else 0,
        "by_status": dict(sorted(by_status.items())),
    }
    out["refusals"] = dict(refusals.most_common())
    out["ended_mid_stream"] = dict(mid_stream.most_common())
    out["transport_errors"] = sum(v for k, v in by_status.items() if k.startswith("transport"))
    limit, peak = target["limit_bytes"], target.get("max_usage_bytes")
    out["peak_fraction_of_bound"] = round(peak / limit, 3) if peak else None
    return out


def verdict(plimsoll: dict) -> tuple[bool, list[str]]:
    """(passed, the reasons it did not)."""
    if not plimsoll.get("ran"):
        return False, [f"did not run: {plimsoll.get('reason')}"]
    why = []
    if plimsoll["oom_kills"]:
        why.append(f"{plimsoll['oom_kills']} OOM kill(s)")
    if plimsoll["deaths"] or not plimsoll["alive_at_end"]:
        why.append(f"the proxy exited: {plimsoll['deaths']}")
    if plimsoll["after_load"]["wedged"]:
        why.append("no request was admitted after the load stopped (wedged): "
                   f"{plimsoll['after_load']['statuses']}")
    bad = {k: v for k, v in plimsoll["refusals"].items()
           if (k.startswith("5") and not k.startswith("503 ")) or "(no code)" in k}
    if bad:
        why.append(f"answers that are not controlled refusals: {bad}")
    if plimsoll["transport_errors"]:
        why.append(f"{plimsoll['transport_errors']} broken connection(s)")
    if plimsoll["tracebacks"]:
        why.append(f"{plimsoll['tracebacks']} traceback(s) in its log")
    if not plimsoll["requests"]["served"]:
        why.append("nothing was served")
    return not why, why


def build(soak: dict, targets: list[dict]) -> dict:
    summaries = [summarize(t) for t in targets]
    ours = next((t for t in summaries if t["label"] == "plimsoll"), {"ran": False,
                                                                     "reason": "not run"})
    passed, why = verdict(ours)
    return {"soak": soak, "targets": summaries, "passed": passed, "failures": why,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MIB:,.0f} MiB"


def markdown(result: dict) -> str:
    s = result["soak"]
    lines = [f"# plimsoll soak — {result['at']}", "",
             f"Models: a = `{s['model_a']}`, b = `{s['model_b']}`; bound: a memory cgroup "
             f"(v{s.get('cgroup_version', '?').lstrip('v')}) of {_mib(s['limit_bytes'])}; "
             f"load: clients at once {', '.join(map(str, s['levels']))} (each level for "
             f"{s['phase_s']:g} s), "
             f"{s['p_churn']:.0%} one-off prompts, {s['p_cancel']:.0%} of streams cancelled, "
             f"{s['p_other_model']:.0%} to model b, idle gaps of {s['idle_gap_s']:g} s every "
             f"{s['idle_every_s']:g} s; plimsoll's policy: context {s['context']}, "
             f"concurrency {s['concurrency']}, idle TTL {s['idle_ttl_s']:g} s, swap hold "
             f"{s.get('swap_hold_s', 0):g} s." + (f" Command: `{s['command']}`." if s.get(
                 "command") else ""), "",
             f"**Verdict: {'PASS' if result['passed'] else 'FAIL'}**"
             + (f" — {'; '.join(result['failures'])}" if result["failures"] else ""), "",
             "| | " + " | ".join(t["label"] for t in result["targets"]) + " |",
             "|---|" + "---|" * len(result["targets"])]

    def row(name: str, fn) -> None:
        lines.append(f"| {name} | " + " | ".join(
            fn(t) if t.get("ran") else "not run" for t in result["targets"]) + " |")

    row("ran for", lambda t: f"{t['load_ran_s']:g} s of load")
    row("requests (served / cancelled mid-stream)", lambda t: (
        f"{t['requests']['total']} ({t['requests']['served']} / "
        f"{t['requests']['cancelled_mid_stream']})"))
    row("refusals by reason", lambda t: ", ".join(f"{k}: {v}" for k, v in t["refusals"].items())
        or "none")
    row("ended mid-stream with an error event", lambda t: ", ".join(
        f"{k}: {v}" for k, v in t["ended_mid_stream"].items()) or "none")
    row("broken connections", lambda t: str(t["transport_errors"]))
    row("OOM kills (its cgroup + below)", lambda t: (
        f"{t['oom_kills']} ({t['oom_kills_in_cgroup']} + {t['oom_kills_below']})"))
    row("exits / restarts", lambda t: "; ".join(
        f"exit {d['exit_status']} at {d['t_s']} s" for d in t["deaths"]) or "none")
    row("first request admitted after the load stopped", lambda t: (
        f"not probed: {t['after_load']['not_probed']}" if t["after_load"].get("not_probed")
        else "never (wedged)" if t["after_load"]["wedged"]
        else f"{t['after_load']['seconds']} s ({t['after_load']['tries']} tries)"))
    row("peak usage (max_usage_in_bytes) / bound", lambda t: (
        f"{_mib(t['max_usage_bytes'])} / {_mib(t['limit_bytes'])} "
        f"({t['peak_fraction_of_bound']})"))
    row("peak working set (usage − inactive file)", lambda t: _mib(t["peak_working_set_bytes"]))
    row("fail count (allocations refused at the limit)", lambda t: str(t["failcnt"]))
    row("largest prompt sent (words)", lambda t: str(t["requests"]["largest_prompt_words"]))
    ours = next((t for t in result["targets"] if t["label"] == "plimsoll" and t.get("ran")),
                None)
    if ours:
        lines += ["", "plimsoll's proxy events: " + ", ".join(
            f"{k} {v}" for k, v in ours["events"].items())
                  + f"; workers SIGKILLed: {ours['workers_sigkilled']}."]
    lines += ["", s.get("note", "")]
    return "\n".join(lines).rstrip() + "\n"


def write(result: dict, out_dir: Path, stem: str | None = None) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or "soak-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    js.write_text(json.dumps(result, indent=2) + "\n")
    md.write_text(markdown(result))
    return js, md
