"""The tools that measure plimsoll against reality: calibrate, doctor, verify.

Owns: :mod:`.calibrate` (the measured calibration run), :mod:`.doctor` (the host diagnosis,
pure), :mod:`.verify` (the cap-comprehensiveness run), :mod:`.soak` (``verify --soak``: a
fixed time of mixed load under a memory cgroup, beside mlx_lm.server) and :mod:`.spike` (the
fault injector, run as ``python -m plimsoll.reliability.spike``; it imports mlx to make an MLX
spike).

May import: :mod:`plimsoll.launch` and everything below it.
"""
