"""The per-process memory guard: a kernel cgroup line, else the process's own footprint line.

Owns: :mod:`.cgroups` (the cgroup v1/v2 effect edge), :mod:`.process` (the guard lines'
arithmetic, the parent-side :class:`~.process.WorkerGuard`, the child-side self and footprint
guards, and ``python -m plimsoll.guard enter DIR -- ARGV…``).

May import: :mod:`plimsoll.core`, :mod:`plimsoll.probes`.
"""
