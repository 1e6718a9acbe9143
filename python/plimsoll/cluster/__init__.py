"""Clustered mode: one model split across ranks on MLX's distributed runtime (ring backend).

Owns: :mod:`.plan` (the pure core: per-rank shares, per-rank admission, the two-phase
decision); :mod:`.weights` (safetensors headers, no mlx); :mod:`.exits` (exit codes, the
failures that carry them, the JSON event lines: shared by every process here);
:mod:`.rank` (the rank process) and :mod:`.stage` (its slice of the model) — the only
modules here that import mlx; :mod:`.protocol` (the lockstep op protocol between rank 0
and its peers); :mod:`.serve` (the worker's HTTP API on rank 0 over the ring);
:mod:`.runner` (supervises the rank processes from outside); :mod:`.launch` (a sharded
model as one worker of the proxy, ``plimsoll cluster serve`` as its process).

May import: :mod:`plimsoll.launch`, :mod:`plimsoll.worker`, :mod:`plimsoll.engine` (in
:mod:`.stage`), :mod:`plimsoll.web`, :mod:`plimsoll.guard`, :mod:`plimsoll.probes`,
:mod:`plimsoll.core`; mlx / mlx_lm in :mod:`.rank` and :mod:`.stage` only.
"""
