"""``pagedattn serve``: an OpenAI-compatible HTTP server on the engine.

``app`` (routes), ``protocol`` (request schemas, error bodies), ``responses`` (response
bodies), ``engine_loop`` (the engine thread and its asyncio bridge), ``metrics``
(Prometheus), ``cli`` (the command). Needs the ``serve`` extra (fastapi, uvicorn,
pydantic, prometheus_client).
"""
