"""``plimsoll verify``: the cap-comprehensiveness run (docs/DESIGN.md, "The invariants").

:mod:`.run` runs it and writes the report; :mod:`.faults` holds the fault kinds (shared by
every target and OS), :mod:`.probe` what is sampled per OS, :mod:`.target` what is driven
(prompts, workload, spike helpers), :mod:`.contrast` ``mlx_lm.server`` under the same line.
"""

from .probe import Sample, Sampler
from .run import run_verify, summary, write_report

__all__ = ["Sample", "Sampler", "run_verify", "summary", "write_report"]
