"""The worker process: one model behind an OpenAI/Anthropic HTTP API, refusing instead of growing.

Owns, by room: the HTTP side — :mod:`.app` (the Starlette app factory, the OpenAI routes and
their streaming, the status report, serving under uvicorn), :mod:`.anthropic_routes` and
:mod:`.responses_routes` (the other protocols on the same scheduler), :mod:`.submit`
(handing a request to the scheduler and streaming its events back); the backend —
:mod:`.backend` (the engine loaded with the process limits, the pool sized, the step's
figures); the scheduler — :mod:`.scheduler` (the thread and the step loop), :mod:`.waiting`
(intake, expiry, the decode-batch bound), :mod:`.prefix` (registered blocks, hybrid state
snapshots), :mod:`.speculate` (prompt-lookup drafts and each sequence's draft length),
:mod:`.trip` (the memory lines), :mod:`.stats` (the published figures),
:mod:`.events` (what the scheduler and the edge exchange), :mod:`.pool` (the pure block pool
the scheduler alone owns); the disk tier — :mod:`.disk_tier` (the files) and
:mod:`.disk_restore` (spilling and reading blocks back). The worker's settings are
:mod:`plimsoll.core.worker_config`.

May import: :mod:`plimsoll.engine`, :mod:`plimsoll.protocol`, :mod:`plimsoll.web`,
:mod:`plimsoll.guard`, :mod:`plimsoll.probes`, :mod:`plimsoll.core`.
"""
