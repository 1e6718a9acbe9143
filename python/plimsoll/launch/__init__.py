"""Admission at launch: live figures in, a sized worker started, verified and guarded out.

Owns: :mod:`.live_admission` (the edge around :func:`plimsoll.core.admission.admit`: live
ceiling, policy, calibration), :mod:`.calibration` (calibration records: key, file, lookup;
the run that writes them is :mod:`plimsoll.reliability.calibrate`), :mod:`.defaults` (the
policy used when none is given, the demo model's place), :mod:`.spawn` (starting, verifying
and stopping a worker process).

May import: :mod:`plimsoll.worker` (its config only), :mod:`plimsoll.demo` (lazily, to
build the demo model), :mod:`plimsoll.guard`, :mod:`plimsoll.probes`, :mod:`plimsoll.core`.
"""
