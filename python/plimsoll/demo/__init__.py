"""Demo models built locally: random weights in a real architecture, a locally trained tokenizer.

Owns: :mod:`.model` (building a demo model; imports mlx / mlx_lm), :mod:`.tokenizer`
(training the byte-level BPE tokenizer it ships).

May import: :mod:`plimsoll.core`, mlx, mlx_lm.
"""
