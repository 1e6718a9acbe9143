"""Summary and markdown of bench/scale.py: every figure side by side, ratios candidate ÷ anchor,
issue 14's targets checked. Memory in GiB (2^30 bytes); the JSON keeps raw bytes.
"""

from __future__ import annotations

GiB = 2**30
TARGETS = {  # figure: (comparison, threshold) — issue 14, "Benchmarks"
    "streams32_ratio": (">=", 1.5), "streams8_ratio": (">=", 1.5),
    "decode_ratio": (">=", 1.5), "stall_gap_ratio": ("<=", 0.5),
    "agentic_peak_over_needed_max": ("<=", 1.15), "agentic_ttft_ratio_max": ("<=", 0.5),
    "sub_kv_held_over_ideal": ("<=", 1.1), "sub_staggered_ratio": ("<=", 0.2),
    "sub_together_ratio": ("<=", 1.5),
}


def _latest(result: dict, phase: str) -> dict[str, dict]:
    """{label: that server's result of ``phase``} from the last group that ran it."""
    out: dict[str, dict] = {}
    for group in result.get("groups", []):
        for label, server in group["servers"].items():
            if phase in server.get("results", {}):
                out[label] = server["results"][phase]
    return out


def _ratio(c: float | None, a: float | None) -> float | None:
    return c / a if c is not None and a else None


def _pair(per: dict[str, dict], get) -> dict:
    a = get(per["anchor"]) if "anchor" in per else None
    c = get(per["candidate"]) if "candidate" in per else None
    return {"anchor": a, "candidate": c, "ratio": _ratio(c, a)}


def _ok_turns(r: dict) -> list[dict]:
    return [t for t in r.get("turns", []) if not t.get("error")]


def summarise(result: dict) -> dict:
    kvpt = result["model"]["kv_bytes_per_token"]
    weights = result["model"]["weights_bytes"]
    bw = (result.get("bandwidth") or {}).get("best_bytes_per_s")
    s: dict = {"figures": {}}
    f = s["figures"]
    ag = _latest(result, "agentic")
    if ag:
        common = min(len(_ok_turns(r)) for r in ag.values())
        per = {k: {"turns": _ok_turns(r)[:common]} for k, r in ag.items()}
        last = {k: (v["turns"][-1] if v["turns"] else {}) for k, v in per.items()}
        f["agentic_last_turn"] = common
        f["agentic_prompt_tokens"] = _pair(last, lambda t: t.get("prompt_tokens"))
        f["agentic_peak_memory"] = _pair(per, lambda r: max(
            (t.get("mem_peak") or 0 for t in r["turns"]), default=0) or None)
        f["agentic_peak_over_needed_last"] = _pair(last, lambda t: t.get("mem_peak_over_needed"))
        f["agentic_peak_over_needed_max"] = _pair(per, lambda r: max(
            (t.get("mem_peak_over_needed") or 0 for t in r["turns"]), default=0) or None)
        f["agentic_mlx_active_over_needed_max"] = _pair(per, lambda r: max(
            (t.get("mlx_active_peak_over_needed") or 0 for t in r["turns"]), default=0) or None)
        f["agentic_ttft_last"] = _pair(last, lambda t: t.get("ttft_s"))
        f["agentic_ttft_sum"] = _pair(per, lambda r: sum(t.get("ttft_s") or 0
                                                         for t in r["turns"]) or None)
        if {"anchor", "candidate"} <= per.keys():
            ratios = [_ratio(c.get("ttft_s"), a.get("ttft_s")) for a, c in
                      zip(per["anchor"]["turns"], per["candidate"]["turns"], strict=False)]
            ratios = [r for r in ratios if r is not None]
            f["agentic_ttft_ratio_max"] = {"ratio": max(ratios) if ratios else None}
    dec = _latest(result, "decode")
    if dec:
        f["decode_tps"] = _pair(dec, lambda r: r.get("decode_tps"))
        f["decode_e2e_tps"] = _pair(dec, lambda r: r.get("e2e_tps"))
        if bw:
            def fraction(r: dict) -> float | None:
                n = r.get("completion_tokens") or 0
                read = weights + ((r.get("prompt_tokens") or 0) + n / 2) * kvpt
                return r["decode_tps"] / (bw / read) if r.get("decode_tps") else None
            prompt = next((r.get("prompt_tokens") for r in dec.values()
                           if r.get("prompt_tokens")), 0) or 0
            f["decode_bandwidth_limit_tps"] = bw / (weights + prompt * kvpt)
            f["decode_fraction_of_limit"] = _pair(dec, fraction)
    for phase in [p for g in result.get("groups", []) for p in g["phases"]]:
        if phase.startswith("streams"):
            st = _latest(result, phase)
            f[f"{phase}_aggregate_tps"] = _pair(st, lambda r: r.get("aggregate_tps"))
            f[f"{phase}_completed"] = _pair(st, lambda r: r.get("completed"))
    stl = _latest(result, "stall")
    if stl:
        f["stall_longest_gap_s"] = _pair(stl, lambda r: r.get("longest_gap_s"))
        f["stall_newcomer_ttft_s"] = _pair(stl, lambda r: r.get("newcomer_ttft_s"))
        f["stall_newcomer_prompt_tokens"] = _pair(
            stl, lambda r: (r.get("newcomer") or {}).get("prompt_tokens"))
        f["stall_streams_ended_early"] = _pair(stl, lambda r: r.get("streams_ended_early"))
    sub = _latest(result, "subagents")
    if sub:
        f.update(_sub_figures(sub, kvpt))
    s["targets"] = _targets(f)
    return s


def _sub_figures(sub: dict[str, dict], kvpt: int) -> dict:
    f: dict = {}
    g = lambda *path: (lambda r: _dig(r, path))  # noqa: E731
    f["sub_alone_ttft_s"] = _pair(sub, g("alone", "ttft_s"))
    f["sub_staggered_first_ttft_s"] = _pair(sub, g("staggered", "first_ttft_s"))
    f["sub_staggered_rest_ttft_max_s"] = _pair(sub, g("staggered", "rest_ttft_max_s"))
    f["sub_staggered_ratio"] = _pair(sub, lambda r: _ratio(
        _dig(r, ("staggered", "rest_ttft_max_s")), _dig(r, ("staggered", "first_ttft_s"))))
    f["sub_together_ttft_max_s"] = _pair(sub, g("together", "ttft_max_s"))
    f["sub_together_ratio"] = _pair(sub, lambda r: _ratio(
        _dig(r, ("together", "ttft_max_s")), _dig(r, ("alone", "ttft_s"))))
    f["sub_together_mem_peak"] = _pair(sub, g("together", "mem_peak"))

    def ideal(r: dict) -> float | None:
        reqs = _dig(r, ("together", "requests")) or []
        shared = r.get("shared_prefix_tokens")
        if not reqs or shared is None or any(q.get("prompt_tokens") is None for q in reqs):
            return None
        own = sum(q["prompt_tokens"] - shared + (q.get("completion_tokens") or 0) for q in reqs)
        return (shared + own) * kvpt

    def one_copy(r: dict) -> float | None:
        q = (_dig(r, ("together", "requests")) or [{}])[0]
        return (q.get("prompt_tokens") or 0) * kvpt + (q.get("completion_tokens") or 0) * kvpt \
            or None

    f["sub_kv_ideal_bytes"] = _pair(sub, ideal)
    f["sub_kv_one_copy_bytes"] = _pair(sub, one_copy)
    f["sub_kv_held_peak"] = _pair(sub, g("together", "kv_bytes_held_peak"))
    f["sub_kv_allocated_peak"] = _pair(sub, g("together", "kv_bytes_allocated_peak"))
    f["sub_kv_held_over_ideal"] = _pair(sub, lambda r: _ratio(
        _dig(r, ("together", "kv_bytes_held_peak")), ideal(r)))
    f["sub_kv_held_over_one_copy"] = _pair(sub, lambda r: _ratio(
        _dig(r, ("together", "kv_bytes_held_peak")), one_copy(r)))

    def usage(key: str):
        def get(r: dict) -> float | None:
            reqs = _dig(r, ("together", "requests")) or []
            vals = [q.get(key) for q in reqs]
            return sum(v for v in vals if v is not None) if reqs else None
        return get

    f["sub_together_prompt_tokens"] = _pair(sub, usage("prompt_tokens"))
    f["sub_together_cached_tokens"] = _pair(sub, usage("cached_tokens"))
    f["sub_together_prefill_tokens_from_usage"] = _pair(sub, lambda r: sum(
        (q.get("prompt_tokens") or 0) - (q.get("cached_tokens") or 0)
        for q in _dig(r, ("together", "requests")) or []) or None)
    f["sub_together_zero_cached_requests"] = _pair(sub, lambda r: sum(
        1 for q in _dig(r, ("together", "requests")) or [] if not q.get("cached_tokens")))
    f["sub_together_status_deltas"] = _pair(sub, g("together", "status_deltas"))
    f["sub_shared_prefix_tokens"] = _pair(sub, lambda r: r.get("shared_prefix_tokens"))
    return f


def _dig(obj, path):
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _targets(f: dict) -> dict:
    values = {
        "streams32_ratio": (f.get("streams32_aggregate_tps") or {}).get("ratio"),
        "streams8_ratio": (f.get("streams8_aggregate_tps") or {}).get("ratio"),
        "decode_ratio": (f.get("decode_tps") or {}).get("ratio"),
        "stall_gap_ratio": (f.get("stall_longest_gap_s") or {}).get("ratio"),
        "agentic_peak_over_needed_max": (f.get("agentic_peak_over_needed_max") or {})
        .get("candidate"),
        "agentic_ttft_ratio_max": (f.get("agentic_ttft_ratio_max") or {}).get("ratio"),
        "sub_kv_held_over_ideal": (f.get("sub_kv_held_over_ideal") or {}).get("candidate"),
        "sub_staggered_ratio": (f.get("sub_staggered_ratio") or {}).get("candidate"),
        "sub_together_ratio": (f.get("sub_together_ratio") or {}).get("candidate"),
    }
    return {k: {"value": v, "want": f"{op} {lim}",
                "met": None if v is None else (v <= lim if op == "<=" else v >= lim)}
            for k, (op, lim) in TARGETS.items() for v in [values[k]]}


def _fmt(v, key: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, dict):
        return ", ".join(f"{k.rsplit('.', 1)[-1]} {_fmt(x)}" for k, x in v.items()) or "–"
    if isinstance(v, bool):
        return str(v)
    if ("bytes" in key or "memory" in key or "mem" in key or "kv_held" in key
            or "kv_allocated" in key) and "over" not in key:
        return f"{v / GiB:.3f} GiB"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) > 100):
        return f"{int(v)}"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def markdown(result: dict) -> str:
    s = result["summary"]
    m, bw = result["model"], result.get("bandwidth") or {}
    lines = [f"# Scale benchmark: {result['args'].get('name')}", "",
             f"Command: `{result['command']}`", "",
             f"Started {result['started']}; host {result['host']}; order {result['order']}.",
             f"Model {m['dir']}: weights {m['weights_bytes'] / GiB:.2f} GiB, KV "
             f"{m['kv_bytes_per_token'] / 1024:.1f} KiB/token.",
             f"Copy bandwidth ({bw.get('device')}, {(bw.get('array_bytes') or 0) / GiB:.2f} GiB "
             f"array): best {(bw.get('best_bytes_per_s') or 0) / 1e9:.1f} GB/s, median "
             f"{(bw.get('median_bytes_per_s') or 0) / 1e9:.1f} GB/s"
             + (f" (error: {bw['error']})" if bw.get("error") else "") + ".", "",
             *[f"Note: {n}" for n in result.get("notes", [])], "",
             "## Figures (ratio = candidate ÷ anchor)", "",
             "| figure | anchor | candidate | ratio |", "|---|---|---|---|"]
    for key, val in s["figures"].items():
        if isinstance(val, dict) and "ratio" in val:
            lines.append(f"| {key} | {_fmt(val.get('anchor'), key)} | "
                         f"{_fmt(val.get('candidate'), key)} | {_fmt(val.get('ratio'))} |")
        else:
            lines.append(f"| {key} | {_fmt(val, key)} | | |")
    lines += ["", "## Targets (issue 14)", "", "| target | value | want | met |",
              "|---|---|---|---|"]
    for key, t in s["targets"].items():
        lines.append(f"| {key} | {_fmt(t['value'])} | {t['want']} | {t['met']} |")
    lines += _turn_table(result) + _servers_table(result)
    return "\n".join(lines) + "\n"


def _turn_table(result: dict) -> list[str]:
    ag = _latest(result, "agentic")
    if not ag:
        return []
    a, c = ag.get("anchor", {}).get("turns", []), ag.get("candidate", {}).get("turns", [])
    out = ["", "## Agentic session, per turn", "",
           "| turn | prompt | cached a / c | TTFT a | TTFT c | ratio | peak a | peak c | "
           "peak ÷ needed a | c | c MLX active ÷ needed |", "|" + "---|" * 11]
    for i in range(max(len(a), len(c))):
        ta, tc = (a[i] if i < len(a) else {}), (c[i] if i < len(c) else {})
        out.append(
            f"| {i + 1} | {ta.get('prompt_tokens') or tc.get('prompt_tokens')} | "
            f"{ta.get('cached_tokens')} / {tc.get('cached_tokens')} | {_fmt(ta.get('ttft_s'))} | "
            f"{_fmt(tc.get('ttft_s'))} | {_fmt(_ratio(tc.get('ttft_s'), ta.get('ttft_s')))} | "
            f"{_fmt(ta.get('mem_peak'), 'mem')} | {_fmt(tc.get('mem_peak'), 'mem')} | "
            f"{_fmt(ta.get('mem_peak_over_needed'))} | {_fmt(tc.get('mem_peak_over_needed'))} | "
            f"{_fmt(tc.get('mlx_active_peak_over_needed'))} |"
            + (f" error: {ta.get('error') or tc.get('error')}" if ta.get("error")
               or tc.get("error") else ""))
    src = next((t.get("mem_source") for t in a + c if t.get("mem_source")), "")
    out += ["", f"Peak memory: {src}; needed = weights + prompt tokens × KV bytes per token."]
    return out


def _servers_table(result: dict) -> list[str]:
    out = ["", "## Servers", "", "| group | server | ready s | wall s | error | argv |",
           "|---|---|---|---|---|---|"]
    for g in result.get("groups", []):
        for label, srv in g["servers"].items():
            errs = srv.get("error") or "; ".join(
                f"{p}: {r['error']}" for p, r in srv.get("results", {}).items()
                if isinstance(r, dict) and r.get("error"))
            out.append(f"| {'+'.join(g['phases'])} | {label} | {_fmt(srv.get('ready_s'))} | "
                       f"{_fmt(srv.get('wall_s'))} | {errs or ''} | "
                       f"`{' '.join(srv.get('argv', []))}` |")
    return out
