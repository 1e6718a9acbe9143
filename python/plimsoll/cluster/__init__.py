"""Clustered mode: one model split across ranks on MLX's distributed runtime (ring backend).

``plan`` is the pure core (per-rank shares, per-rank admission, the two-phase decision);
``weights`` reads safetensors headers (no mlx); ``rank`` is the rank process (the only
module here that imports mlx); ``protocol`` is the lockstep op protocol between rank 0 and
its peers; ``serve`` puts the worker's HTTP API on rank 0 over the ring; ``runner``
supervises the rank processes from outside; ``launch`` makes a sharded model one worker of
the proxy (``plimsoll cluster serve`` as its process).
"""
