"""Token-exact prompt keys, and where the gateway falls back to characters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.contracts.chat import render_chat
from gateway.contracts.chat_template import load_chat_template
from gateway.contracts.kv_keys import chain_seed, token_block_keys
from gateway.kvevents.endpoints import EventEndpoints, split_url
from gateway.kvevents.tokenize import PromptTokenizer, TokenizerError, TokenizerOptions
from loadtest.tiny_tokenizer import train
from worker.parsing import parse_chat
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


async def test_leading_ids_are_the_first_tokens_the_engine_runs(
    tokenizer: PromptTokenizer, tok_path: str
) -> None:
    """A chat's first N token ids as the worker encodes its rendered chat (the pre-warmer sends
    a held prefix with them); a completions prompt's with its special tokens; None for fewer
    tokens than asked, or a chat with an image (its tokens are not its ids alone)."""
    messages = [{"role": "system", "content": "You answer billing questions. " * 5},
                {"role": "user", "content": "Where is my invoice?"}]
    worker_ids = HFTokenizer(tok_path).encode(render_chat(messages))
    ids = await tokenizer.leading_ids({"messages": messages}, chat=True, tokens=12)
    assert ids == worker_ids[:12]
    assert await tokenizer.leading_ids({"messages": messages}, chat=True,
                                       tokens=len(worker_ids) + 1) is None
    prompt = await tokenizer.leading_ids({"prompt": "one prompt " * 9}, chat=False, tokens=5)
    assert prompt == tokenizer.encode("one prompt " * 9, special=True)[:5]
    assert await tokenizer.leading_ids({"prompt": [5, 6, 7, 8]}, chat=False,
                                       tokens=3) == [5, 6, 7]
    image = [{"role": "user", "content": [
        {"type": "text", "text": "What is this? " * 9},
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]
    assert await tokenizer.leading_ids({"messages": image}, chat=True, tokens=4) is None


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


JINJA = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A tokenizer with a BOS post-processor and its tokenizer_config.json (Jinja template)."""
    root = tmp_path_factory.mktemp("bos")
    tok = str(train(root / "tokenizer.json", bos="<s>"))
    config = root / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": JINJA, "bos_token": "<s>"}))
    return tok, str(config)


async def test_model_template_and_bos_match_the_worker(bos_model: tuple[str, str]) -> None:
    tok_path, config = bos_model
    t = PromptTokenizer(TokenizerOptions(tok_path, block_size=4, threads=1, chat_template=config))
    worker = HFTokenizer(tok_path)
    bos = worker.encode("<s>")
    try:
        messages = [{"role": "system", "content": "You answer billing questions. " * 5},
                    {"role": "user", "content": "Where is my invoice?"}]
        body: dict[str, object] = {"messages": messages}
        chat = await t.key(body, chat=True, salt="")
        assert chat is not None
        # The worker renders with the same template (ChatParams), encodes without adding more.
        params = parse_chat({"model": "m", **body}, "m", load_chat_template(config))
        worker_ids = worker.encode(params.prompt, special=params.special_tokens)
        assert worker_ids[: len(bos)] == bos  # the template wrote BOS
        assert list(chat.key.blocks) == token_block_keys(worker_ids, 4, chain_seed("", ""))
        # Completions get the post-processor's BOS unless the request turns it off.
        text = "Where is my invoice? " * 4
        with_bos = await t.key({"prompt": text}, chat=False, salt="")
        without = await t.key({"prompt": text, "add_special_tokens": False}, chat=False, salt="")
        assert with_bos is not None
        assert without is not None
        assert with_bos.tokens == len(worker.encode(text, special=True)) == without.tokens + 1
        no_prompt = await t.key({**body, "add_generation_prompt": False}, chat=True, salt="")
        assert no_prompt is not None
        assert no_prompt.tokens < chat.tokens
    finally:
        t.close()


def test_bad_chat_template_is_a_tokenizer_error(tok_path: str, tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer_config.json"
    bad.write_text("{}")
    with pytest.raises(TokenizerError, match="no chat_template"):
        PromptTokenizer(TokenizerOptions(tok_path, chat_template=str(bad)))
