"""The serving comparison's figures, ratios and targets, and its markdown.

Figures are per server label (``anchor``, ``candidate`` or ``plimsoll-<kv>``); ratios divide
each server by a base: the anchor (``mlx_lm.server``), and in a quantized-KV run also
plimsoll at the model's dtype (``plimsoll-auto``). Agentic figures compare the servers at
the last turn all of them completed, so a server killed early is compared on the turns it
served. Memory in GiB (2^30 bytes); the JSON keeps raw bytes.
"""

from __future__ import annotations

from lib.report import DASH, GiB, num, table

# name: (figure, "ratio" to the anchor or the candidate's own "value", comparison, threshold)
TARGETS: dict[str, dict[str, tuple[str, str, str, float]]] = {
    "scale": {  # the scale work: batching, prefix sharing and chunked prefill pay off
        "streams32_ratio": ("streams32_aggregate_tps", "ratio", ">=", 1.5),
        "streams8_ratio": ("streams8_aggregate_tps", "ratio", ">=", 1.5),
        "decode_ratio": ("decode_tps", "ratio", ">=", 1.5),
        "stall_gap_ratio": ("stall_longest_gap_s", "ratio", "<=", 0.5),
        "agentic_peak_over_needed_max": ("agentic_peak_over_needed_max", "value", "<=", 1.15),
        "agentic_ttft_ratio_max": ("agentic_ttft_ratio_max", "value", "<=", 0.5),
        "sub_kv_live_over_ideal": ("sub_kv_live_over_ideal", "value", "<=", 1.1),
        "sub_staggered_ratio": ("sub_staggered_ratio", "value", "<=", 0.2),
        "sub_together_ratio": ("sub_together_ratio", "value", "<=", 1.5),
    },
    "parity": {  # memory-safe serving costs nothing against mlx_lm.server
        "agentic_peak_over_needed_last": ("agentic_peak_over_needed_last", "value", "<=", 1.15),
        "agentic_ttft_last_ratio": ("agentic_ttft_last", "ratio", "<=", 1.0),
        "decode_ratio": ("decode_tps", "ratio", ">=", 1.0),
        "streams8_ratio": ("streams8_aggregate_tps", "ratio", ">=", 1.0),
        "agentic_peak_over_allocation_limit": ("agentic_peak_over_allocation_limit", "value",
                                               "<=", 1.0),
    },
    "none": {},
}


def _latest(result: dict, phase: str) -> dict[str, dict]:
    """{label: the server's record} from the last group that ran ``phase``."""
    out: dict[str, dict] = {}
    for group in result.get("groups", []):
        for label, server in group["servers"].items():
            if phase in server.get("results", {}):
                out[label] = server
    return out


def _ratio(c: float | None, a: float | None) -> float | None:
    return c / a if c is not None and a else None


def _dig(obj, *path):
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _ok_turns(r: dict) -> list[dict]:
    return [t for t in r.get("turns", []) if not t.get("error")]


def bases(labels: list[str]) -> list[str]:
    return [b for b in ("anchor", "plimsoll-auto") if b in labels]


def summarise(result: dict) -> dict:
    weights = result["model"]["weights_bytes"]
    kvpt = {label: result.get("kv_bytes_per_token", {}).get(label)
            or result["model"]["kv_bytes_per_token"] for label in result["order"]}
    bw = (result.get("bandwidth") or {}).get("best_bytes_per_s")
    f: dict = {}

    def per(phase: str, get) -> dict:
        return {label: get(server["results"][phase], label)
                for label, server in _latest(result, phase).items()}

    ag = _latest(result, "agentic")
    if ag:
        common = min(len(_ok_turns(s["results"]["agentic"])) for s in ag.values())
        turns = {k: _ok_turns(s["results"]["agentic"])[:common] for k, s in ag.items()}
        last = {k: (t[-1] if t else {}) for k, t in turns.items()}
        f["agentic_last_turn"] = common
        f["agentic_prompt_tokens"] = {k: t.get("prompt_tokens") for k, t in last.items()}
        f["agentic_peak_memory"] = {k: max((x.get("mem_peak") or 0 for x in t), default=0)
                                    or None for k, t in turns.items()}
        f["agentic_peak_over_needed_last"] = {k: t.get("mem_peak_over_needed")
                                              for k, t in last.items()}
        f["agentic_peak_over_needed_max"] = {k: max(
            (x.get("mem_peak_over_needed") or 0 for x in t), default=0) or None
            for k, t in turns.items()}
        f["agentic_mlx_active_peak"] = {k: max((x.get("mlx_active_peak") or 0 for x in t),
                                               default=0) or None for k, t in turns.items()}
        f["agentic_mlx_active_over_needed_max"] = {k: max(
            (x.get("mlx_active_peak_over_needed") or 0 for x in t), default=0) or None
            for k, t in turns.items()}
        f["agentic_kv_held_last"] = {k: t.get("kv_bytes_held_end") for k, t in last.items()}
        f["agentic_peak_over_allocation_limit"] = {k: _ratio(
            f["agentic_peak_memory"][k], _dig(ag[k], "status_fields_last", "allocation_limit"))
            for k in ag}
        f["agentic_ttft_last"] = {k: t.get("ttft_s") for k, t in last.items()}
        f["agentic_ttft_sum"] = {k: sum(x.get("ttft_s") or 0 for x in t) or None
                                 for k, t in turns.items()}
        if "anchor" in turns:
            f["agentic_ttft_ratio_max"] = {k: max((r for a, c in zip(
                turns["anchor"], t, strict=False)
                if (r := _ratio(c.get("ttft_s"), a.get("ttft_s"))) is not None), default=None)
                for k, t in turns.items() if k != "anchor"}
    if _latest(result, "decode"):
        f["decode_tps"] = per("decode", lambda r, _: r.get("decode_tps"))
        f["decode_e2e_tps"] = per("decode", lambda r, _: r.get("e2e_tps"))
        f["decode_completion_tokens"] = per("decode", lambda r, _: r.get("completion_tokens"))
        if bw:
            def fraction(r: dict, label: str) -> float | None:
                n = r.get("completion_tokens") or 0
                read = weights + ((r.get("prompt_tokens") or 0) + n / 2) * kvpt[label]
                return r["decode_tps"] / (bw / read) if r.get("decode_tps") else None

            prompt = next((p for p in per("decode", lambda r, _: r.get("prompt_tokens"))
                           .values() if p), 0)
            f["decode_bandwidth_limit_tps"] = bw / (weights + prompt * min(kvpt.values()))
            f["decode_fraction_of_limit"] = per("decode", fraction)
    for phase in dict.fromkeys(p for g in result.get("groups", []) for p in g["phases"]):
        if phase.startswith("streams"):
            f[f"{phase}_aggregate_tps"] = per(phase, lambda r, _: r.get("aggregate_tps"))
            f[f"{phase}_completed"] = per(phase, lambda r, _: r.get("completed"))
    if _latest(result, "stall"):
        f["stall_longest_gap_s"] = per("stall", lambda r, _: r.get("longest_gap_s"))
        f["stall_newcomer_ttft_s"] = per("stall", lambda r, _: r.get("newcomer_ttft_s"))
        f["stall_newcomer_prompt_tokens"] = per("stall",
                                                lambda r, _: _dig(r, "newcomer", "prompt_tokens"))
        f["stall_streams_ended_early"] = per("stall", lambda r, _: r.get("streams_ended_early"))
    if _latest(result, "subagents"):
        f.update(_sub_figures(per, kvpt, result["model"]))
    labels = [x for x in result["order"] if any(isinstance(v, dict) and x in v
                                                 for v in f.values())] or result["order"]
    out = {"labels": labels, "bases": bases(labels), "figures": f}
    out["ratios"] = {f"{label} ÷ {base}": {k: _ratio(v.get(label), v.get(base))
                                           for k, v in f.items() if isinstance(v, dict)}
                     for base, label in ratio_columns(labels)}
    out["targets"] = targets(f, labels, result.get("targets", "scale"))
    return out


def _most(xs: list[float] | None) -> float | None:
    return max(xs) if xs else None


def prefill_flops(model: dict, new: int, start: int) -> float | None:
    """FLOPs of computing ``new`` prompt tokens after ``start`` cached ones, for a dense
    model: 2 a weight a token over the layers' projections and MLP (the embedding and the lm
    head left out), plus causal attention on every full-attention layer, 4 × heads ×
    head_dim a query–key pair (QKᵀ and PV). None where the record lacks a field."""
    try:
        h, inter, layers = model["hidden_size"], model["intermediate_size"], model["num_layers"]
        heads, kvh, hd = (model["num_attention_heads"], model["num_key_value_heads"],
                          model["head_dim"])
        full = layers - (model.get("sliding_layers") or 0)
    except KeyError:
        return None
    if None in (h, inter, layers, heads, kvh, hd) or new <= 0:
        return None
    per_token = layers * 2 * (h * (heads + 2 * kvh) * hd + heads * hd * h + 3 * h * inter)
    pairs = new * start + new * (new + 1) / 2  # each new query sees the cached keys and its own
    return new * per_token + full * 4 * heads * hd * pairs


def _work_floors(model: dict, r: dict) -> tuple[float | None, float | None]:
    """What the sub-agent ratios would be if every prompt token cost what the model's FLOPs
    say (the same device efficiency for a cold prompt and a tail at a long prefix): the 7
    staggered tails together ÷ the first request; together, the prefix once and every task
    ÷ the request alone. A server can only beat these by running tails more efficiently
    than a cold prompt."""
    def work(q: dict | None) -> float | None:
        if not q or q.get("prompt_tokens") is None:
            return None
        cached = q.get("cached_tokens") or 0
        return prefill_flops(model, q["prompt_tokens"] - cached, cached)

    st = r.get("staggered") or {}
    first, rest = work(st.get("first")), [work(q) for q in st.get("rest") or []]
    staggered = (sum(rest) / first if first and rest and None not in rest else None)
    shared, reqs = r.get("shared_prefix_tokens"), _dig(r, "together", "requests") or []
    alone = work(r.get("alone"))
    tasks = [prefill_flops(model, q["prompt_tokens"] - shared, shared) for q in reqs
             if shared and q.get("prompt_tokens") is not None]
    prefix = prefill_flops(model, shared, 0) if shared else None
    together = ((prefix + sum(tasks)) / alone if alone and prefix and tasks
                and len(tasks) == len(reqs) and None not in tasks else None)
    return staggered, together


def _sub_figures(per, kvpt: dict[str, int], model: dict) -> dict:
    def ideal(r: dict, label: str) -> float | None:
        reqs = _dig(r, "together", "requests") or []
        shared = r.get("shared_prefix_tokens")
        if not reqs or shared is None or any(q.get("prompt_tokens") is None for q in reqs):
            return None
        own = sum(q["prompt_tokens"] - shared + (q.get("completion_tokens") or 0) for q in reqs)
        return (shared + own) * kvpt[label]

    def one_copy(r: dict, label: str) -> float | None:
        q = (_dig(r, "together", "requests") or [{}])[0]
        return ((q.get("prompt_tokens") or 0) + (q.get("completion_tokens") or 0)) \
            * kvpt[label] or None

    def held(r: dict) -> float | None:
        return _dig(r, "together", "kv_bytes_held_peak")

    def live(r: dict) -> float | None:
        """Distinct blocks the live sequences hold (no cached blocks of earlier phases:
        ``kv_bytes_held`` counts those too, so it overstates what the phase holds)."""
        return _dig(r, "together", "kv_bytes_live_peak")

    def total(key: str):
        def get(r: dict, _: str) -> float | None:
            reqs = _dig(r, "together", "requests") or []
            return sum(q.get(key) or 0 for q in reqs) if reqs else None
        return get

    def at(*path):
        return lambda r, _: _dig(r, *path)

    floors = per("subagents", lambda r, _: _work_floors(model, r))
    return {
        "sub_warm_ttft_s": per("subagents", at("warm", "ttft_s")),
        "sub_alone_ttft_s": per("subagents", at("alone", "ttft_s")),
        "sub_staggered_first_ttft_s": per("subagents", at("staggered", "first_ttft_s")),
        "sub_staggered_rest_ttft_max_s": per("subagents", at("staggered", "rest_ttft_max_s")),
        "sub_staggered_ratio": per("subagents", lambda r, _: _ratio(
            _dig(r, "staggered", "rest_ttft_max_s"), _dig(r, "staggered", "first_ttft_s"))),
        "sub_together_ttft_max_s": per("subagents", at("together", "ttft_max_s")),
        "sub_together_ratio": per("subagents", lambda r, _: _ratio(
            _dig(r, "together", "ttft_max_s"), _dig(r, "alone", "ttft_s"))),
        # the server's clock (its access lines): the client's adds its own work
        "sub_staggered_server_ratio": per("subagents", lambda r, _: _ratio(
            _most(_dig(r, "staggered", "server_rest_ttft_s")),
            _most(_dig(r, "staggered", "server_first_ttft_s")))),
        "sub_together_server_ratio": per("subagents", lambda r, _: _ratio(
            _most(_dig(r, "together", "server_ttft_s")),
            _most(_dig(r, "alone", "server_ttft_s")))),
        "sub_staggered_work_floor": {k: v[0] for k, v in floors.items()},
        "sub_together_work_floor": {k: v[1] for k, v in floors.items()},
        "sub_together_mem_peak": per("subagents", at("together", "mem_peak")),
        "sub_kv_ideal_bytes": per("subagents", ideal),
        "sub_kv_one_copy_bytes": per("subagents", one_copy),
        "sub_kv_held_peak": per("subagents", lambda r, _: held(r)),
        "sub_kv_allocated_peak": per("subagents", at("together", "kv_bytes_allocated_peak")),
        "sub_kv_held_over_ideal": per("subagents", lambda r, k: _ratio(held(r), ideal(r, k))),
        "sub_kv_live_peak": per("subagents", lambda r, _: live(r)),
        "sub_kv_live_over_ideal": per("subagents", lambda r, k: _ratio(live(r), ideal(r, k))),
        "sub_kv_held_over_one_copy": per("subagents",
                                         lambda r, k: _ratio(held(r), one_copy(r, k))),
        "sub_together_prompt_tokens": per("subagents", total("prompt_tokens")),
        "sub_together_cached_tokens": per("subagents", total("cached_tokens")),
        "sub_together_prefill_tokens_from_usage": per("subagents", lambda r, _: sum(
            (q.get("prompt_tokens") or 0) - (q.get("cached_tokens") or 0)
            for q in _dig(r, "together", "requests") or []) or None),
        "sub_together_zero_cached_requests": per("subagents", lambda r, _: sum(
            1 for q in _dig(r, "together", "requests") or [] if not q.get("cached_tokens"))),
        "sub_together_status_deltas": per("subagents", at("together", "status_deltas")),
        "sub_shared_prefix_tokens": per("subagents", at("shared_prefix_tokens")),
    }


def ratio_columns(labels: list[str]) -> list[tuple[str, str]]:
    """(base, label) pairs: every server ÷ the anchor; quantized KV ÷ the model's dtype."""
    out = [("anchor", x) for x in labels if x != "anchor" and "anchor" in labels]
    if "plimsoll-auto" in labels:
        out += [("plimsoll-auto", x) for x in labels if x.startswith("plimsoll-")
                and x != "plimsoll-auto"]
    return out


def targets(f: dict, labels: list[str], name: str) -> dict:
    out: dict = {}
    for target, (figure, kind, op, lim) in TARGETS[name].items():
        values = f.get(figure) if isinstance(f.get(figure), dict) else {}
        row = {}
        for label in (x for x in labels if x != "anchor"):
            v = _ratio(values.get(label), values.get("anchor")) if kind == "ratio" \
                else values.get(label)
            row[label] = {"value": v, "met": None if v is None else
                          (v <= lim if op == "<=" else v >= lim)}
        out[target] = {"want": f"{op} {lim}", "of": kind, "servers": row}
    return out


def _fmt(v, key: str = "") -> str:
    if v is None:
        return DASH
    if isinstance(v, dict):
        return ", ".join(f"{k.rsplit('.', 1)[-1]} {_fmt(x)}" for k, x in v.items()) or DASH
    if isinstance(v, bool):
        return str(v)
    if (any(w in key for w in ("bytes", "memory", "mem", "kv_held", "kv_live", "kv_allocated",
                               "mlx_active_peak")) and "over" not in key):
        return f"{v / GiB:.3f} GiB"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) > 100):
        return f"{int(v)}"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def markdown(result: dict) -> str:
    s = result["summary"]
    m, bw = result["model"], result.get("bandwidth") or {}
    labels, cols = s["labels"], ratio_columns(s["labels"])
    lines = [f"# Serving side by side: {result['name']}", "",
             f"Command: `{result['command']}`", "",
             f"Started {result['started']}. {result['host_line']} Servers in order: "
             f"{', '.join(result['order'])}.",
             f"Model {m['dir']}: weights {m['weights_bytes'] / GiB:.2f} GiB, KV "
             f"{m['kv_bytes_per_token'] / 1024:.1f} KiB/token at the model's dtype.",
             f"Copy bandwidth ({bw.get('device')}, {(bw.get('array_bytes') or 0) / GiB:.2f} GiB "
             f"array): best {(bw.get('best_bytes_per_s') or 0) / 1e9:.1f} GB/s, median "
             f"{(bw.get('median_bytes_per_s') or 0) / 1e9:.1f} GB/s"
             + (f" (error: {bw['error']})" if bw.get("error") else "") + ".", "",
             *[f"Note: {n}" for n in result.get("notes", [])],
             *([""] if result.get("notes") else []), "## Figures", ""]
    rows = []
    for key, val in s["figures"].items():
        if isinstance(val, dict):
            rows.append([key, *(_fmt(val.get(x), key) for x in labels),
                         *(_fmt(_ratio(val.get(x), val.get(b))) for b, x in cols)])
        else:
            rows.append([key, _fmt(val, key), *([""] * (len(labels) + len(cols) - 1))])
    lines += table(["figure", *labels, *(f"{x} ÷ {b}" for b, x in cols)], rows)
    if s["targets"]:
        cands = [x for x in labels if x != "anchor"]
        lines += ["", f"## Targets ({result.get('targets')})", ""]
        lines += table(["target", "want", *cands], [
            [key, f"{t['of']} {t['want']}", *(
                f"{_fmt(t['servers'][x]['value'])} ({_met(t['servers'][x]['met'])})"
                for x in cands)] for key, t in s["targets"].items()])
    lines += _turn_table(result, labels) + _servers_table(result)
    return "\n".join(lines) + "\n"


def _met(met: bool | None) -> str:
    return {True: "yes", False: "**no**"}.get(met, DASH)


def _turn_table(result: dict, labels: list[str]) -> list[str]:
    ag = _latest(result, "agentic")
    if not ag:
        return []
    turns = {x: ag[x]["results"]["agentic"].get("turns", []) for x in labels if x in ag}
    cols = ["cached", "TTFT s", "peak GiB", "peak ÷ needed", "MLX active ÷ needed",
            "KV held GiB"]
    rows = []
    for i in range(max(len(t) for t in turns.values())):
        recs = {x: (t[i] if i < len(t) else {}) for x, t in turns.items()}
        row = [i + 1, next((r["prompt_tokens"] for r in recs.values()
                            if r.get("prompt_tokens")), None)]
        for r in recs.values():
            if r.get("error"):
                row += [f"error: {r['error'][:60]}", *([""] * (len(cols) - 1))]
                continue
            row += [r.get("cached_tokens"), num(r.get("ttft_s")), _fmt(r.get("mem_peak"), "mem"),
                    num(r.get("mem_peak_over_needed")),
                    num(r.get("mlx_active_peak_over_needed")),
                    _fmt(r.get("kv_bytes_held_end"), "kv_held")]
        rows.append(row)
    src = next((t.get("mem_source") for ts in turns.values() for t in ts
                if t.get("mem_source")), "")
    return ["", "## Agentic session, per turn", "",
            *table(["turn", "prompt", *(f"{x} {c}" for x in turns for c in cols)], rows),
            "", f"Peak memory: {src}; needed = weights + prompt tokens × KV bytes per token "
            "(one KV copy of the session); MLX active and KV held from plimsoll's status."]


def _servers_table(result: dict) -> list[str]:
    rows = []
    for g in result.get("groups", []):
        for label, srv in g["servers"].items():
            errs = srv.get("error") or "; ".join(
                f"{p}: {r['error']}" for p, r in srv.get("results", {}).items()
                if isinstance(r, dict) and r.get("error"))
            rows.append(["+".join(g["phases"]), label, _fmt(srv.get("ready_s")),
                         _fmt(srv.get("wall_s")), errs or "",
                         f"`{' '.join(srv.get('argv', []))}`"])
    return ["", "## Servers", "",
            *table(["group", "server", "ready s", "wall s", "error", "argv"], rows)]
