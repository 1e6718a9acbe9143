"""The link watcher: the OS wired ceiling follows the cluster link, safely.

The mode's ceiling, held (docs/DESIGN.md, "The process model"). The mode is clustered while
the cluster link is up and standalone while it is down; the ceiling
(``iogpu.wired_limit_mb``, or a file on Linux and in tests) is held at that mode's budget.
Raising is safe, so an upshift raises the ceiling before the proxy may use the larger
envelope; lowering does not reclaim wired memory, so a downshift waits until the proxy has
evicted down to the smaller envelope, and no ceiling is ever written below the memory
observed in use.

Layout: ``decide`` is the pure core (observation in, action out); ``link`` reads the
link and ``sysctl`` writes the ceiling (the only two effects, each behind one
interface); ``proxy_client`` is the one network call (the local proxy's admin
endpoint); ``run`` is the loop that wires them together.

May import: :mod:`plimsoll.probes`, :mod:`plimsoll.core`; the proxy only over HTTP.
"""
