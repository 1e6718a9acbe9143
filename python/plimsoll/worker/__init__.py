"""The worker: one model behind an OpenAI/Anthropic HTTP API, refusing instead of growing.

Two processes (docs/DESIGN.md, "The process model"). The API process — :mod:`.app` (the
Starlette app factory, the OpenAI routes and their streaming, the status report, serving
under uvicorn), :mod:`.anthropic_routes`, :mod:`.responses_routes` and :mod:`.ollama_routes`
(the other protocols on the same path), :mod:`.submit` (a request handed to the scheduler,
its events streamed back), :mod:`.engine_client` (the engine process started, spoken to,
its crash noticed), :mod:`.tokenizer` (the engine's tokenizer, without mlx) and
:mod:`.prompt_pieces` (prompts tokenized piece by piece, long pieces' ids kept). The engine
process — :mod:`.engine_proc` (its main: the wire's reader, a pass's events as one
message), :mod:`.backend` (the engine loaded with the process limits, the pool sized, the
step's figures), the scheduler — :mod:`.scheduler` (the thread, the step loop, the plan),
:mod:`.waiting` (intake, the waiters a step admits, expiry, the decode-batch bound),
:mod:`.prefix` (an admission's hit blocks, prompt chunks, registered blocks, hybrid state
snapshots), :mod:`.speculate` (prompt-lookup drafts, each sequence's draft length, steps in
flight), :mod:`.speculate_steps` (speculation's part of each step: reads, Works, settling),
:mod:`.ngram` (prompt lookup's search),
:mod:`.draft_model` (a draft model's proposals on its own paged KV,
its load-time checks), :mod:`.mtp` (the checkpoint's MTP head as the proposer),
:mod:`.trip` (the memory lines, what a trip sheds), :mod:`.stats` (the
published figures), :mod:`.pool` (the pure block pool the scheduler alone owns) — and the
disk tier, :mod:`.disk_tier` (the files) and :mod:`.disk_restore` (spilling and reading
blocks back). Between them: :mod:`.events` (requests and events) and :mod:`.ipc` (the wire).
The worker's settings are :mod:`plimsoll.core.worker_config`.

May import: :mod:`plimsoll.engine`, :mod:`plimsoll.protocol`, :mod:`plimsoll.web`,
:mod:`plimsoll.constrain`, :mod:`plimsoll.guard`, :mod:`plimsoll.probes`,
:mod:`plimsoll.core`.
"""
