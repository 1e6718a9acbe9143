"""``plimsoll verify --soak`` and ``bench/soak.py``: a soak that shows the bound holds.

:mod:`.load` is what the clients send (concurrency 2–8, prompt-cache churn, growing agentic
sessions, cancellations, swaps, idle gaps), :mod:`.run` runs it against ``plimsoll serve``
and ``mlx_lm.server``, each in a memory cgroup sized so that an unbounded server is
OOM-killed, and measures; :mod:`.report` counts, judges and writes JSON and Markdown.
"""

from .load import Shape
from .report import markdown, write
from .run import Soak, run_soak

__all__ = ["Shape", "Soak", "markdown", "run_soak", "write"]
