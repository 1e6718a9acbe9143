"""Clustered mode: one model split across ranks on MLX's distributed runtime.

Owns: :mod:`.plan` (the pure core: per-rank shares split by layers or tensor parallel,
per-rank admission, the two-phase decision); :mod:`.rank_facts` (the model facts of a
rank's share: what its engine serves; pure); :mod:`.backend` (which MLX backend, ring /
jaccl / nccl, what each reads at launch and what its buffers cost; pure); :mod:`.weights`
(safetensors headers, no mlx); :mod:`.exits` (exit codes, the failures that carry them,
the JSON event lines: shared by every process here); :mod:`.rank` (the rank process),
:mod:`.stage` (its slice of the model on a per-layer loop, and the group's messages) and
:mod:`.engine_stage` (its slice, or its split of every layer, on the worker's engine) —
the only modules here that import mlx; :mod:`.protocol` (the lockstep slot protocol
between rank 0 and its peers) and
:mod:`.wire` (engine calls as messages, pure); :mod:`.serve` (the worker's HTTP API on
rank 0 over the ring) and :mod:`.engine_serve` (rank 0's stdin requests on the engine);
:mod:`.runner` (supervises the rank processes from outside) and :mod:`.rank_cgroups`
(their memory cgroups); :mod:`.launch` (a sharded model as one worker of the proxy,
``plimsoll cluster serve`` as its process).

May import: :mod:`plimsoll.launch`, :mod:`plimsoll.worker`, :mod:`plimsoll.engine` (its
pure ``work`` and ``pool`` anywhere, its ``core`` in :mod:`.engine_stage`),
:mod:`plimsoll.web`, :mod:`plimsoll.guard`, :mod:`plimsoll.probes`, :mod:`plimsoll.core`;
mlx / mlx_lm in :mod:`.rank`, :mod:`.stage` and :mod:`.engine_stage` only.
"""
