"""Admission at launch: live figures in, a sized worker started, verified and guarded out.

Owns: :mod:`.live_admission` (the edge around :mod:`plimsoll.core.admission`: live ceiling,
policy, calibration), :mod:`.calibration` (calibration records: key, file, lookup; the run
that writes them is :mod:`plimsoll.reliability.calibrate`), :mod:`.defaults` (the policy
used when none is given, the demo model's place), :mod:`.serve_sizing` (the model entry
``plimsoll serve`` sizes), :mod:`.model_source` (``--model DIR|ORG/NAME`` to a local
directory), :mod:`.spawn` (starting, verifying and stopping a worker process).

May import: :mod:`plimsoll.demo` (lazily, to build the demo model), :mod:`plimsoll.guard`,
:mod:`plimsoll.probes`, :mod:`plimsoll.core` (the worker's contract and every figure of
admission among it); never :mod:`plimsoll.worker` or :mod:`plimsoll.engine` (a worker is a
process it starts; ``.importlinter`` checks it).
"""
