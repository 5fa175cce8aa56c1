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

# The worker process's boot id: a new value means it restarted with a cold cache.
WORKER_BOOT_HEADER = "x-worker-boot-id"
