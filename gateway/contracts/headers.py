"""HTTP header names the gateway and its workers agree on."""

# The request's cache namespace (tenant, joined with its cache_salt), set by the gateway only.
NAMESPACE_HEADER = "x-cache-namespace"

# What the worker reused for a response (also in the body's ``usage``).
INPUT_TOKENS_HEADER = "x-cache-input-tokens"
MATCHED_TOKENS_HEADER = "x-cache-matched-tokens"
MATCHED_BLOCKS_HEADER = "x-cache-matched-blocks"
HIT_RATIO_HEADER = "x-cache-hit-ratio"
CACHE_STAT_HEADERS = (INPUT_TOKENS_HEADER, MATCHED_TOKENS_HEADER, MATCHED_BLOCKS_HEADER,
                      HIT_RATIO_HEADER)

# When the worker's engine finished a whole (non-streamed) response's request and freed its KV
# blocks: seconds on the host's monotonic clock, the clock of the gateway's ``x-route-at``
# (the reference worker; the live replay's simulator frees the blocks then too).
ENGINE_DONE_HEADER = "x-engine-done-at"
# ... and when its prefill was done (its first token), from which an engine that reuses a
# block only once computed lets other requests reuse the prompt's blocks.
ENGINE_COMPUTED_HEADER = "x-engine-computed-at"

# The worker process's boot id: a new value means it restarted with a cold cache.
WORKER_BOOT_HEADER = "x-worker-boot-id"
