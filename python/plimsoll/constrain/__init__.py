"""Constrained decoding: JSON output and forced tool calls as per-token masks (pure + numpy).

Owns: :class:`Spec` (what a request asks for: JSON, JSON matching a schema, or one call of
a forced tool in the model's own tool-call markup), its grammar, and
:class:`GrammarConstraint`, the engine's ``TokenConstraint`` (``allowed()`` a bool mask over
the vocabulary, ``advance(token)``, ``done()``). No mlx: the engine applies the mask.

Library: **llguidance**, chosen by measurement on this CPU (bench/constrain_libs.py, the
demo tokenizer's 4,096 ids, a 7-property schema with a nested object, an array, an enum, a
pattern and numbers; a 101-token document; bench/results/constrain-libs-cpu-2026-12-01.md):

======================  ===========  ==========  =========================================
library                 mask/token   compile     install / tokenizer.json support
======================  ===========  ==========  =========================================
llguidance 1.9.1        0.03 ms med  1.7 ms      7.7 MB, no dependencies; takes a
                        0.05 mean                ``tokenizers`` tokenizer.json directly
outlines-core 0.2.14    0.007 ms med 24 ms       5.3 MB; no tokenizer.json loader (only a
                        0.11 mean,               hub download): the byte-level vocabulary
                        0.31 p95                 must be rebuilt by hand; the index is
                                                 compiled eagerly over the whole vocabulary
                                                 (grows with vocab × regex states); JSON
                                                 Schema via a regex (no recursion)
xgrammar 0.2.9          0.011 ms med 12 ms       3.9 MB + apache-tvm-ffi 13 MB + hard
                        0.015 mean               requirements on torch and (Linux x86_64)
                                                 triton: hundreds of MB to GB for a worker
                                                 that runs MLX; measured with torch stubbed
======================  ===========  ==========  =========================================

All three are far below a decode step of the tiny demo (~2-5 ms), so the mask is not what
decides; llguidance is the one with no heavy dependencies, a direct tokenizer.json loader,
lazy masks (compile stays ~ms with a large vocabulary) and Lark grammars that embed JSON
Schema, which the forced tool call needs (markers around a JSON body).
"""

from .matcher import Constrainer, GrammarConstraint
from .spec import Spec, SpecError, ToolMarkup, check_schema, json_value, lark, tool_call

__all__ = ["Constrainer", "GrammarConstraint", "Spec", "SpecError", "ToolMarkup",
           "check_schema", "json_value", "lark", "tool_call"]
