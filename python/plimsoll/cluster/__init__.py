"""Clustered mode: one model split across ranks on MLX's distributed runtime (ring backend).

``plan`` is the pure core (per-rank shares, per-rank admission, the two-phase decision);
``weights`` reads safetensors headers (no mlx); ``rank`` is the rank process (the only
module here that imports mlx); ``runner`` supervises the rank processes from outside.
"""
