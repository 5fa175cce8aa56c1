"""Contracts the gateway and the reference worker share, and nothing else of the gateway.

* the worker record (``worker_record``), its signature (``registry_signing``) and the Redis
  registry it is stored in, with the client a worker registers itself with (``registry``);
* chat rendering and roles (``chat``, ``chat_template``), the OpenAI error body (``errors``),
  the header names both sides read and write (``headers``) and the engine metric names a
  worker exports and the gateway reads (``engine_metrics``);
* the KV-cache event wire format (``kv_wire``) and the block keys both sides compute
  (``kv_keys``);
* the servers' plumbing: settings from flags, environment and TOML (``config``,
  ``config_file``), the HTTP runner that answers its own errors as JSON and cancels a
  request whose client went away (``httpserver``), task helpers (``tasks``), tracing setup
  (``tracing``) and URL redaction for logs (``redact``).
"""
