"""The reference worker's store of Responses API answers, kept as an engine with a response
store keeps them (vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE``): in this process's memory,
bounded (past ``--stored-responses`` the oldest go), by id. Like vLLM's, it does not tell
tenants apart: the gateway does (:mod:`gateway.response_pins`), and sends a tenant's request
for an id only if that tenant's request made it.

A stored answer keeps the conversation it ends (the chat messages before it, its input's and
its own; the instructions are not carried over, as the Responses API specifies), which a next
turn by ``previous_response_id`` continues, and its input items for
``GET /v1/responses/{id}/input_items``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: Mapping[str, Any]  # the response object as it was answered
    conversation: tuple[Mapping[str, Any], ...]  # chat messages up to its answer, included
    input_items: tuple[Mapping[str, Any], ...]


class ResponseStore:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, stored: StoredResponse) -> None:
        if self.max_entries <= 0:
            return
        key = str(stored.response["id"])
        self._stored[key] = stored
        self._stored.move_to_end(key)
        while len(self._stored) > self.max_entries:
            self._stored.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._stored.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._stored.pop(response_id, None) is not None


def answer_text(response: Mapping[str, Any]) -> str:
    """The assistant's text in a response object (its output messages' text parts)."""
    pieces: list[str] = []
    for item in response.get("output") or ():
        if isinstance(item, Mapping) and item.get("type") == "message":
            for part in item.get("content") or ():
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
    return "".join(pieces)


def input_items(body: Mapping[str, Any], response_id: str) -> tuple[dict[str, Any], ...]:
    """A request's ``input`` as the list of items the Responses API returns, each with an id
    (a string input is one user message)."""
    raw = body.get("input")
    items: Sequence[Any] = ([{"type": "message", "role": "user",
                              "content": [{"type": "input_text", "text": raw}]}]
                            if isinstance(raw, str) else raw if isinstance(raw, list) else [])
    base = response_id.removeprefix("resp_")
    return tuple({"id": f"item_{base}_{i}", **item} if "id" not in item else dict(item)
                 for i, item in enumerate(items) if isinstance(item, dict))
