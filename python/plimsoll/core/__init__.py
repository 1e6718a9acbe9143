"""The pure core every process shares: values in, values out, no I/O beyond reading a file.

Owns: :mod:`.units` (byte units and formatting), :mod:`.policy` (the host policy models and
the committed ``policy.schema.json``), :mod:`.model_facts` (a model's memory facts:
:mod:`.cache_layout`, the cache every layer holds, from ``config.json``;
:mod:`.safetensors_header`, the weight bytes, from safetensors headers),
:mod:`.admission` (the admission decision, its context clamp counting the transient),
:mod:`.sizing` (every pool figure: blocks per sequence, fixed blocks, right-sized pools, the
worker's start-up check, cache caps, the output-length rule, the shared envelope and release
checks), :mod:`.transients` (every compute transient the engine holds and the prefill-chunk
rule), :mod:`.worker_config` (the worker's contract: every setting, declared once),
:mod:`.capability` (which models the engine serves), :mod:`.aliases` (which served model
answers a request's name), :mod:`.weights_key` (what identifies a model's weights and
engine), :mod:`.paths` (where plimsoll keeps what it builds) and :mod:`.progress` (the ``Reporter``
that long work reports through).

May import: nothing of plimsoll outside ``core`` (the bottom layer; no mlx).
"""
