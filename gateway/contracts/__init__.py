"""Contracts the gateway and the reference worker share, and nothing else of the gateway:
the worker record (``worker_record``) and its signature (``registry_signing``), chat rendering
and roles (``chat``, ``chat_template``), the OpenAI error body (``errors``) and the aiohttp
middleware that cancels a request whose client went away (``disconnect``)."""
