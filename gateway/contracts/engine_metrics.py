"""Engine metrics a worker exports on ``/metrics`` and the gateway reads when it probes: vLLM's
names, which the reference worker exports too. Counters appear with the ``_total`` suffix."""

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"  # counter, in tokens
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"  # counter, in tokens
CACHE_CONFIG_INFO = "vllm:cache_config_info"  # labels block_size, num_gpu_blocks
# Histogram: seconds each request waited for admission (its ``_sum`` and ``_count`` samples).
QUEUE_TIME = "vllm:request_queue_time_seconds"
QUEUE_TIME_SUM = QUEUE_TIME + "_sum"
QUEUE_TIME_COUNT = QUEUE_TIME + "_count"
# Histogram: seconds from each request's arrival to its first token.
FIRST_TOKEN_TIME = "vllm:time_to_first_token_seconds"
FIRST_TOKEN_TIME_SUM = FIRST_TOKEN_TIME + "_sum"
FIRST_TOKEN_TIME_COUNT = FIRST_TOKEN_TIME + "_count"


def total(counter: str) -> str:
    """The sample name of a counter in the Prometheus text format."""
    return counter + "_total"
