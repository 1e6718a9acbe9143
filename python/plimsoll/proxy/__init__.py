"""The swapping proxy: one OpenAI endpoint, workers spawned through admission, no overlap.

- :mod:`.evict` — the pure eviction decision (which running workers must stop);
- :mod:`.sizing` — pure arithmetic: the shared envelope, right-sized pools, release checks;
- :mod:`.state` — one state machine per worker process (stopped → starting → ready →
  stopping), the only writer of that state;
- :mod:`.supervisor` — the transition lock, bounded waiting queues, bring-ups, verified
  release, idle unload;
- :mod:`.app` / :mod:`.admin` — the HTTP edge (Starlette app factory) and the admin
  contract the link watcher calls.
"""

from .app import make_app
from .supervisor import ProxyError, Settings, Supervisor

__all__ = ["ProxyError", "Settings", "Supervisor", "make_app"]
