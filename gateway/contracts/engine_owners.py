"""Which engine serves a worker, as its ``/v1/models`` names itself (``owned_by``).

The gateway asks an engine to run the volume guard's session copies at a background
scheduling ``priority`` (:mod:`gateway.warmup`) only where it knows what the answer means.
vLLM (and the reference worker, which follows it) refuses a ``priority`` other than 0 with a
400 unless it runs priority scheduling (``--scheduling-policy priority``), and then runs lower
values first: its answer to a one-token request carrying the priority says whether a copy
sent with it yields. Other engines do not: SGLang ignores a priority unless started with
``--enable-priority-scheduling`` and by default runs *higher* values first, and llama.cpp
ignores the field, so a 200 from them would say nothing, or the opposite.
"""

from __future__ import annotations

VLLM_OWNER = "vllm"  # vLLM's OpenAI server: every model card's ``owned_by``
REFERENCE_OWNER = "affinity-worker"  # the reference worker's (worker.server)

# Engines that take ``priority`` as vLLM does (refused unless scheduled by; lower first).
PRIORITY_AS_VLLM = frozenset({VLLM_OWNER, REFERENCE_OWNER})


def owner_of(entries: list[dict[str, object]]) -> str:
    """The engine that serves a ``/v1/models`` listing: the ``owned_by`` its model cards
    share ("" when they name none, or not the same one)."""
    owners = {e.get("owned_by") for e in entries}
    if len(owners) != 1:
        return ""
    owner = owners.pop()
    return owner if isinstance(owner, str) else ""
