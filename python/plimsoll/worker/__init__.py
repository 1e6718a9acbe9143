"""The worker process: one model behind an OpenAI/Anthropic HTTP API, refusing instead of growing.

Owns: :mod:`.config` (the worker's figures, fixed at launch), :mod:`.scheduler` (admission of
requests onto the KV pool, the decode loop), :mod:`.app` (the Starlette app factory and the
OpenAI routes), :mod:`.anthropic_routes` (the Anthropic routes on the same path).

May import: :mod:`plimsoll.engine`, :mod:`plimsoll.protocol`, :mod:`plimsoll.web`,
:mod:`plimsoll.guard`, :mod:`plimsoll.probes`, :mod:`plimsoll.core`.
"""
