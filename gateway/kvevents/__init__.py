"""Engine-exact cache knowledge from the engines' KV-cache events.

* :mod:`~gateway.contracts.kv_wire`: vLLM's ZMQ/msgpack event format (decode and encode);
* :mod:`~gateway.contracts.kv_keys`: block keys of token ids, the same on both sides of the wire;
* :mod:`~gateway.kvevents.index`: one bounded block set per worker, and the matcher that puts
  it behind the routing's prefix-match interface (pure: no I/O);
* :mod:`~gateway.kvevents.subscriber`: the ZMQ subscriptions, with gap replay (the only module
  here that does I/O);
* :mod:`~gateway.kvevents.tokenize`: the served model's tokenizer and chat template, run off
  the event loop.
"""
