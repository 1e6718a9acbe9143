"""The dashboard: one static page at ``GET /`` polling ``GET /dashboard.json``.

The page (``dashboard.html``, package data) has no build step and fetches nothing from
outside: inline CSS and JS draw the host line, the stacked usage, each worker's pool, the
recent refusals and the memory timeline (inline SVG). The JSON is the observer's live
reading (:mod:`.metrics`), polled afresh on each call, plus its sampled timeline.

With ``--api-key`` set the page itself is public (it holds no data) and ``/dashboard.json``
asks for the key; open the page as ``/#key=KEY`` and the script sends it as a bearer token.
"""

from __future__ import annotations

import time
from functools import cache
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from .gauges import Poll
from .metrics import Observer
from .metrics_edge import allowed

POOL_KEYS = ("total", "used", "cached", "free", "shared", "cache_cap")


@cache
def page_html() -> str:
    return resources.files(__package__).joinpath("dashboard.html").read_text(encoding="utf-8")


async def page(request: Request) -> Response:
    return HTMLResponse(page_html(), headers={"Cache-Control": "no-cache"})


def worker_view(obs: Observer, p: Poll, name: str) -> dict[str, Any]:
    w = p.workers[name]
    st = p.status.get(name) or {}
    adm = w.get("admitted") or {}
    pool = st.get("pool") or {}
    lim = st.get("limits") or {}
    mlx = st.get("mlx") or {}
    ctx = st.get("context") or {}
    served = {o: int(v) for (m, o), v in _requests(obs).items() if m == name}
    return {
        "model": name, "state": w["state"], "pid": w.get("pid"),
        "inflight": w.get("inflight", 0), "waiting_for_load": w.get("waiting_for_load", 0),
        "pool": {k: pool.get(k) for k in POOL_KEYS} if pool else None,
        "block_bytes": st.get("block_bytes"), "block_tokens": st.get("block_tokens"),
        "running": st.get("running"), "waiting": st.get("waiting"),
        "context": adm.get("context") or ctx.get("configured"),
        "concurrency": adm.get("concurrency"), "max_tokens": ctx.get("max_tokens"),
        "weights_bytes": adm.get("weights_bytes"),
        "footprint_bytes": adm.get("footprint_bytes"),
        "rss_bytes": st.get("rss_bytes"), "mlx_active_bytes": mlx.get("active_bytes"),
        "allocation_limit_bytes": lim.get("allocation_limit_bytes"),
        "trip_bytes": lim.get("trip_bytes"), "u": lim.get("gpu_memory_utilization"),
        "tripped": bool(st.get("tripped")), "trips": obs.trips(name),
        "requests": served, "last_exit": w.get("last_exit"),
        "disk": ({k: st["disk"].get(k) for k in ("state", "reason", "hits", "misses",
                                                  "size_bytes", "cap_bytes")}
                 if st.get("disk") else None),
    }


def _requests(obs: Observer) -> dict[tuple[str, str], float]:
    out = {}
    for metric in obs.requests.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[(s.labels["model"], s.labels["outcome"])] = s.value
    return out


async def data(request: Request) -> Response:
    if not allowed(request):
        from .admin import unauthorized

        return unauthorized("API key")
    obs: Observer = request.app.state.observer
    p = await obs.poll()
    return JSONResponse({
        "t": time.time(), "host": p.host, "usage": obs.usage(p) if p.host else None,
        "workers": [worker_view(obs, p, n) for n in sorted(p.workers)],
        "refusals": list(reversed(obs.recent)),
        "timeline": list(obs.timeline), "sample_s": obs.sample_s,
    })
