"""Plimsoll's ``GET /v1/plimsoll/status``, read defensively.

Every numeric field is flattened to a lower-cased key path (``memory.mlx_active_bytes`` …)
and the figures a report uses are looked up by predicate on that path, first match wins, so
the benchmarks read the worker's status whatever its nesting, and a server without the
endpoint (``mlx_lm.server``) simply has none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import httpx

from lib.samplers import Sampler

PATH = "/v1/plimsoll/status"

# figure -> predicate on the flattened, lower-cased key path (first match wins)
KEYS: dict[str, Callable[[str], bool]] = {
    "kv_bytes_held": lambda k: k.endswith("kv_bytes_held"),
    "kv_bytes_live": lambda k: k.endswith("kv_bytes_live"),
    "kv_bytes_allocated": lambda k: k.endswith("kv_bytes_allocated"),
    "kv_bytes_bound": lambda k: k.endswith("kv_bytes_bound"),
    "mlx_active": lambda k: "mlx" in k and "active" in k,
    "mlx_peak": lambda k: "mlx" in k and "peak" in k,
    "rss_reported": lambda k: k.rsplit(".", 1)[-1].startswith("rss") or k.endswith(".rss_bytes"),
    "allocation_limit": lambda k: "allocation_limit" in k,
    "prefill_tokens": lambda k: k.endswith(
        ("prefill_tokens", "prefill_tokens_computed", "prefilled_tokens")),
    "prefix_hits": lambda k: k.endswith(("prefix_hits", "hit_blocks", "prefix_hit_tokens",
                                         "hits")),
    "prefix_misses": lambda k: k.endswith(("prefix_misses", "miss_blocks", "misses")),
    "cached_tokens": lambda k: k.endswith("cached_tokens"),
    "shared_blocks": lambda k: k.endswith("shared_blocks"),
}


def flatten(obj: object, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}; keys lower-cased so field lookup is forgiving."""
    if not isinstance(obj, dict):
        return {prefix: obj}
    out: dict[str, object] = {}
    for key, value in obj.items():
        out.update(flatten(value, f"{prefix}.{key}".lower() if prefix else str(key).lower()))
    return out


def numeric(status: dict) -> dict[str, float]:
    return {k: float(v) for k, v in flatten(status).items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def figures(status: dict) -> dict[str, float | None]:
    """Every figure of :data:`KEYS` from one raw snapshot (None where absent)."""
    flat = numeric(status)
    return {name: next((v for k, v in flat.items() if match(k)), None)
            for name, match in KEYS.items()}


def counter_deltas(before: dict | None, after: dict | None) -> dict[str, float]:
    """after − before of every counter-like field (numeric, a path containing "hit", "miss" or
    "prefill", or ending in "cached_tokens") between two raw snapshots."""
    if not before or not after:
        return {}
    b, a = numeric(before), numeric(after)
    keys = [k for k in a if k in b and (any(w in k for w in ("hit", "miss", "prefill"))
                                        or k.endswith("cached_tokens"))]
    return {k: a[k] - b[k] for k in keys}


def get(base_url: str, path: str = PATH) -> dict | None:
    """One raw snapshot, or None where the server has no such endpoint."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = httpx.get(base_url + path, timeout=5.0)
        if response.status_code == 200 and isinstance(body := response.json(), dict):
            return body
    return None


def wait_plans(base_url: str, path: str, most_s: float, poll_s: float = 0.5) -> dict:
    """Wait (at most ``most_s``) until the worker's idle attention-plan warmer has built every
    shape it planned (``attention_plans.built == planned``); what it found, and the wait."""
    import time

    start, last = time.perf_counter(), {}
    while True:
        flat = numeric(get(base_url, path) or {})
        built = next((v for k, v in flat.items() if k.endswith("attention_plans.built")), None)
        planned = next((v for k, v in flat.items() if k.endswith("attention_plans.planned")),
                       None)
        last = {"built": built, "planned": planned}
        if built is None or planned is None or built >= planned:
            break
        if time.perf_counter() - start >= most_s:
            break
        time.sleep(poll_s)
    return last | {"waited_s": round(time.perf_counter() - start, 2)}


def sampler(base_url: str, path: str, interval: float) -> tuple[Sampler, dict]:
    """A sampler of the status endpoint's figures; the dict holds the last raw snapshot."""
    raw: dict = {}

    def probe() -> dict[str, float | None]:
        response = httpx.get(base_url + path, timeout=2.0)
        response.raise_for_status()
        snapshot = response.json()
        raw.clear()
        raw.update(snapshot)
        return figures(snapshot)

    return Sampler(probe, interval), raw
