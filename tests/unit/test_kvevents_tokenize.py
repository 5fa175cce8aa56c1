"""Token-exact prompt keys, and where the gateway falls back to characters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.contracts.chat import render_chat
from gateway.kvevents.endpoints import EventEndpoints, split_url
from gateway.kvevents.keys import chain_seed, token_block_keys
from gateway.kvevents.tokenize import PromptTokenizer, TokenizerError, TokenizerOptions
from loadtest.tiny_tokenizer import train
from worker.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(train(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


@pytest.fixture
def tokenizer(tok_path: str) -> Iterator[PromptTokenizer]:
    t = PromptTokenizer(TokenizerOptions(tok_path, block_size=4, threads=1))
    yield t
    t.close()


async def test_chat_keys_match_the_workers_tokens(
    tokenizer: PromptTokenizer, tok_path: str
) -> None:
    messages = [{"role": "system", "content": "You answer billing questions. " * 5},
                {"role": "user", "content": "Where is my invoice?"}]
    out = await tokenizer.key({"messages": messages}, chat=True, salt="tenant")
    assert out is not None
    worker_ids = HFTokenizer(tok_path).encode(render_chat(messages))
    assert out.tokens == len(worker_ids)
    assert list(out.key.blocks) == token_block_keys(worker_ids, 4, chain_seed("", "tenant"))
    assert tokenizer.stats.prompts == 1
    assert tokenizer.stats.seconds > 0


async def test_completion_prompts(tokenizer: PromptTokenizer) -> None:
    ids = await tokenizer.key({"prompt": [5, 6, 7, 8, 9]}, chat=False, salt="")
    assert ids is not None
    assert (ids.tokens, len(ids.key.blocks)) == (5, 1)
    text = await tokenizer.key({"prompt": ["one prompt"]}, chat=False, salt="")
    assert text is not None
    assert text.tokens > 0
    short = await tokenizer.key({"prompt": [1]}, chat=False, salt="")
    assert short is not None
    assert short.key.blocks == ()
    assert short.key.anchor != 0


@pytest.mark.parametrize(("body", "chat"), [
    ({"prompt": ["two", "prompts"]}, False),
    ({"prompt": [1, -2]}, False),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True),
    ({"messages": "not a list"}, True),
])
async def test_what_it_cannot_tokenize_falls_back(
    tokenizer: PromptTokenizer, body: dict[str, object], chat: bool
) -> None:
    assert await tokenizer.key(body, chat=chat, salt="") is None
    assert tokenizer.stats.fallbacks == 1


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError):
        PromptTokenizer(TokenizerOptions(str(tmp_path / "missing.json")))


def test_worker_url_fragment() -> None:
    assert split_url("http://h:1") == ("http://h:1", None)
    assert split_url("http://h:1#kv-events=tcp://h:5557&kv-replay=tcp://h:5558") == (
        "http://h:1", EventEndpoints("tcp://h:5557", "tcp://h:5558"))
    for bad, why in (("http://h:1#kv-replay=tcp://h:2", "needs kv-events"),
                     ("http://h:1#kv-events=http://h:2", "tcp:// or ipc://"),
                     ("http://h:1#other=1", "unknown worker URL option")):
        with pytest.raises(ValueError, match=why):
            split_url(bad)
