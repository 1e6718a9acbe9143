"""A per-step memory trace for diagnosis: ``PLIMSOLL_STEP_TRACE=FILE`` (off by default).

Each line is JSON: what the scheduler was about to do (a planned step's decode rows and
chunks as ``[tokens, start]``, or ``"warm"``: one attention plan built while idle) and MLX's
active, cache and peak bytes since the line before (the peak is reset after each line, so
the status's ``mlx.peak_bytes`` is per step while tracing). The benchmarks read it to tell
which step held what (bench/README.md).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

ENV = "PLIMSOLL_STEP_TRACE"


class StepTrace:
    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the worker

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def line(self, engine: Any, what: str, step: Any = None, n: int = 0) -> None:
        mem = engine.memory(reset_peak=True)
        row: dict[str, Any] = {"t": round(time.monotonic(), 4), "what": what, **mem}
        if step is not None:
            row.update(step=n, decodes=len(step.decodes),
                       chunks=[[w.length, w.start] for w in step.prefills])
        self._file.write(json.dumps(row) + "\n")
