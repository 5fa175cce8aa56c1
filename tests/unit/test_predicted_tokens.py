"""What the gateway predicts a worker will report as cached, with token-exact keys."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.fingerprint import PrefixKey
from gateway.proxy import predicted_tokens
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.ring import Ring
from gateway.routing.types import Decision, RouteRequest, Snapshot, Worker, WorkerView


def case(kind: str, held: Sequence[int], blocks: Sequence[int], prompt_tokens: int,
         block_tokens: int = 16) -> int | None:
    index = PrefixIndex()
    index.record(held, "w")
    view = WorkerView(Worker("w", "http://w", kind=kind))
    snapshot = Snapshot(workers=(view,), index=index, ring=Ring({"w": 1.0}))
    request = RouteRequest(PrefixKey(tuple(blocks), 0, 0), "m", 0, prompt_tokens,
                           block_tokens=block_tokens)
    return predicted_tokens(snapshot, request, Decision(view, "p", "r"))


def test_token_keys_predict_whole_blocks_held() -> None:
    assert case("openai", [1, 2], [1, 2, 3], prompt_tokens=50) == 32
    assert case("openai", [1, 2, 3], [1, 2, 3], prompt_tokens=48) == 48


def test_vllm_recomputes_the_last_token_of_a_fully_cached_prompt() -> None:
    assert case("vllm", [1, 2, 3], [1, 2, 3], prompt_tokens=48) == 32
    assert case("vllm", [1, 2, 3], [1, 2, 3], prompt_tokens=49) == 48


def test_character_keys_have_no_token_prediction() -> None:
    assert case("openai", [1], [1], prompt_tokens=10, block_tokens=0) is None
