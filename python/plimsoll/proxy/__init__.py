"""The swapping proxy: one OpenAI/Anthropic endpoint, workers spawned through admission.

Owns:
- :mod:`.evict` / :mod:`.pressure` — the pure decisions (which workers must stop; the
  tripwire's levels and actions);
- :mod:`.state` — one state machine per worker process (stopped → starting → ready →
  stopping), the only writer of that state;
- :mod:`.supervisor` — bounded waiting queues, bring-ups, evictions, idle unload, under
  :mod:`.lock` (the transition lock) and :mod:`.release` (verified release);
- :mod:`.tripwire` — the memory-pressure backstop, acting through the narrow
  :class:`~.tripwire.Host` interface the supervisor implements;
- :mod:`.events`, :mod:`.errors`, :mod:`.settings` — the event log, the refusals, the figures;
- :mod:`.app` / :mod:`.routing` / :mod:`.admin` / :mod:`.metrics` / :mod:`.metrics_edge` /
  :mod:`.dashboard` — the HTTP edge (Starlette app factory and its relay), which served model
  a body names, the admin contract the link watcher calls, Prometheus metrics (the observer
  and ``GET /metrics``) and the dashboard.

May import: :mod:`plimsoll.cluster` (to start a sharded model), :mod:`plimsoll.launch`,
:mod:`plimsoll.guard`, :mod:`plimsoll.web`, :mod:`plimsoll.protocol`, :mod:`plimsoll.probes`,
:mod:`plimsoll.core` (the worker's contract among it); never the engine (workers are
processes it spawns).
"""

from .app import make_app
from .errors import ProxyError
from .settings import Settings
from .supervisor import Supervisor

__all__ = ["ProxyError", "Settings", "Supervisor", "make_app"]
