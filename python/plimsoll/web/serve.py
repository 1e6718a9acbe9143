"""How plimsoll's HTTP servers run: uvicorn's options, the log format, a free loopback port.

One home for what the worker, rank 0 of a cluster and the proxy share: quiet uvicorn on
httptools with h11's bound on a request head (:mod:`.http_head`: enormous or endless headers
get a 400 and a close before the app sees them), a bounded number of connections, a bounded
graceful shutdown.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

LOG_FORMAT = "%(asctime)s %(name)s %(message)s"


def uvicorn_options(*, limit_concurrency: int, graceful_s: float) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config`` (besides app, host, port)."""
    from .http_head import BoundedHttpTools  # uvicorn's internals: only where a server runs

    return {"log_level": "warning", "timeout_graceful_shutdown": graceful_s,
            "limit_concurrency": limit_concurrency, "http": BoundedHttpTools}


def basic_logging() -> None:
    """Timestamped INFO lines on stderr, as every plimsoll server process logs."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's pick), for a worker or a rank."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
