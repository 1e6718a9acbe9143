"""The HTTP edge shared by the worker and the proxy (Starlette): bounded request bodies and
error answers in the route's own protocol.

Owns: :mod:`.body` (reading a body under the size limit), :mod:`.errors` (OpenAI- or
Anthropic-shaped error JSON, the 404/405 handler), :mod:`.local_origin` (the 403 to other
sites' browser requests: DNS rebinding, cross-site POSTs), :mod:`.worker_secret` (a worker
answers only the launcher that gave it its secret).

May import: :mod:`plimsoll.protocol`, :mod:`plimsoll.core`.
"""
