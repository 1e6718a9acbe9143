"""The tools that measure plimsoll against reality: calibrate, doctor, verify.

Owns: :mod:`.calibrate` (the measured calibration run), :mod:`.doctor` (the host diagnosis,
pure), :mod:`.verify` (the cap-comprehensiveness run) and :mod:`.spike` (its fault injector,
run as ``python -m plimsoll.reliability.spike``; it imports mlx to make an MLX spike).

May import: :mod:`plimsoll.launch` and everything below it.
"""
