"""A prompt that extends one tokenized before is encoded past the shared text only, and its keys
are exactly those of encoding it whole."""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from prometheus_client import CollectorRegistry
from tokenizers import models, normalizers, pre_tokenizers, trainers

from gateway.contracts.kv_keys import token_block_keys
from gateway.kvevents.token_prefix import PrefixStoreOptions, TokenPrefixStore
from gateway.kvevents.tokenize import PromptTokenizer, TokenizerOptions
from gateway.telemetry.metrics import TokenizerCollector
from loadtest.tiny_tokenizer import train

BLOCK = 4
OPTS = PrefixStoreOptions(stride=256, margin=32, overlap=4, fine=64)
WORDS = ("billing", "invoice", "wörld", "日本語", "emoji😀", "  ", "\n", "\t", ",", "...",
         "x", "a" * 80, "def f(x):\n    return x\n")


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tokenizers.Tokenizer:
    path = train(tmp_path_factory.mktemp("tok") / "tokenizer.json", bos="<s>")
    return tokenizers.Tokenizer.from_file(str(path))


MakeTokenizer = Callable[..., PromptTokenizer]


@pytest.fixture
def make_tokenizer(tmp_path: Path) -> Iterator[MakeTokenizer]:
    """PromptTokenizers over a locally trained tokenizer (with BOS), closed afterwards."""
    path = str(train(tmp_path / "tokenizer.json", bos="<s>"))
    made: list[PromptTokenizer] = []

    def make(**options: Any) -> PromptTokenizer:
        made.append(PromptTokenizer(TokenizerOptions(path, block_size=BLOCK, **options)))
        return made[-1]

    yield make
    for tok in made:
        tok.close()


def _store(tok: tokenizers.Tokenizer, opts: PrefixStoreOptions = OPTS) -> TokenPrefixStore:
    return TokenPrefixStore(
        lambda text, special: tok.encode_batch([text], add_special_tokens=special)[0], BLOCK,
        opts)


def _whole(tok: tokenizers.Tokenizer, text: str, special: bool, seed: int) -> list[int]:
    return token_block_keys(tok.encode(text, add_special_tokens=special).ids, BLOCK, seed)


def _text(rng: random.Random, n: int, words: tuple[str, ...] = WORDS) -> str:
    return "".join(rng.choice(words) + (" " if rng.random() < 0.7 else "") for _ in range(n))


@pytest.mark.parametrize("special", [False, True])
def test_a_growing_session_is_encoded_past_what_it_shares(
    bos_tokenizer: tokenizers.Tokenizer, special: bool
) -> None:
    # Words shorter than the margin: a pre-token that runs across a cut fails the check (the
    # next test has those).
    store, rng, words = _store(bos_tokenizer), random.Random(1), WORDS[:-2]
    context = _text(rng, 200, words)
    for _ in range(12):
        context += _text(rng, rng.randint(20, 120), words)  # the next turn
        out = store.encode(context, special=special, seed=7)
        whole = bos_tokenizer.encode(context, add_special_tokens=special).ids
        assert out.keys == token_block_keys(whole, BLOCK, 7)
        assert out.tokens == len(whole)
    s = store.stats
    assert s.reused == 11  # every turn after the first
    assert s.mismatches == 0
    assert s.reused_tokens > s.lookups * 100


def test_prompts_that_part_anywhere_keep_exact_keys(bos_tokenizer: tokenizers.Tokenizer) -> None:
    store, rng = _store(bos_tokenizer), random.Random(2)
    base = _text(rng, 600)
    for _ in range(150):
        cut = rng.randrange(len(base))  # mid-word, mid-character run, anywhere
        text = base[:cut] + _text(rng, rng.randint(0, 40))
        special = rng.random() < 0.5
        out = store.encode(text, special=special, seed=3)
        assert out.keys == _whole(bos_tokenizer, text, special, 3)
    assert store.stats.reused > 50


def test_fine_checkpoints_resume_near_where_prompts_part(
    bos_tokenizer: tokenizers.Tokenizer,
) -> None:
    # A shared system prompt that ends inside a stride, then a different short question: the
    # fine checkpoints of the last strides let each later prompt resume near the question.
    rng = random.Random(8)
    system = _text(rng, 400, WORDS[:-2])[: 5 * 256 + 200]
    questions = [_text(rng, 6, WORDS[:-2]) for _ in range(20)]
    encoded = {}
    for fine in (0, 64):
        store = _store(bos_tokenizer, PrefixStoreOptions(stride=256, margin=32, overlap=4,
                                                         fine=fine))
        total = 0
        for i, question in enumerate(questions):
            text = system + question
            out = store.encode(text, special=i % 2 == 1, seed=5)
            assert out.keys == _whole(bos_tokenizer, text, i % 2 == 1, 5)
            total += out.tokens if i > 1 else 0
        assert store.stats.mismatches == 0
        # Every prompt but the first with special tokens and the first without.
        assert store.stats.reused == len(questions) - 2
        encoded[fine] = total - store.stats.reused_tokens  # tokens encoded after the first
    assert encoded[64] < 0.6 * encoded[0]


def test_a_prompt_that_goes_on_long_after_parting_uses_a_fine_checkpoint(
    bos_tokenizer: tokenizers.Tokenizer,
) -> None:
    # The second prompt parts from the first inside a stride, then goes on for strides more:
    # the first prompt's fine checkpoints still let it resume near where they part.
    rng = random.Random(9)
    first = _text(rng, 400, WORDS[:-2])[: 5 * 256 + 100]
    second = first[: 5 * 256 + 70] + _text(rng, 150, WORDS[:-2])
    reused = {}
    for fine in (0, 64):
        store = _store(bos_tokenizer, PrefixStoreOptions(stride=256, margin=32, overlap=4,
                                                         fine=fine))
        store.encode(first, special=False, seed=2)
        out = store.encode(second, special=False, seed=2)
        assert out.keys == _whole(bos_tokenizer, second, False, 2)
        assert store.stats.reused == 1
        reused[fine] = store.stats.reused_tokens
    assert reused[64] > reused[0]


def _trained(pre: pre_tokenizers.PreTokenizer, normalizer: normalizers.Normalizer | None,
             rng: random.Random) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator([_text(rng, 50) for _ in range(50)], trainers.BpeTrainer(
        vocab_size=300, show_progress=False))
    return tok


def test_a_sentencepiece_style_tokenizer_keeps_exact_keys() -> None:
    rng = random.Random(4)
    tok = _trained(pre_tokenizers.Metaspace(prepend_scheme="always"), None, rng)
    store = _store(tok)
    context = _text(rng, 200)
    for _ in range(6):
        context += _text(rng, 30)
        assert store.encode(context, special=False, seed=1).keys == _whole(tok, context, False, 1)
    assert store.stats.reused + store.stats.mismatches == 5


def test_a_tokenizer_that_fails_the_check_is_encoded_whole() -> None:
    # A normalizer that writes a marker in front of any text it is given: the text after a
    # cut, encoded alone, starts with a token the prompt does not have there.
    rng = random.Random(4)
    tok = _trained(pre_tokenizers.Whitespace(), normalizers.Prepend("#"), rng)
    store = _store(tok)
    context = _text(rng, 200)
    for _ in range(6):
        context += _text(rng, 30)
        assert store.encode(context, special=False, seed=1).keys == _whole(tok, context, False, 1)
    assert store.stats.reused == 0
    assert store.stats.mismatches >= 5  # up to three cuts tried per prompt


def test_namespaces_share_nothing(bos_tokenizer: tokenizers.Tokenizer) -> None:
    store, rng = _store(bos_tokenizer), random.Random(5)
    text = _text(rng, 300)
    store.encode(text, special=False, seed=1)
    store.encode(text, special=False, seed=2)  # another tenant, same document
    assert store.stats.reused == 0
    store.encode(text + " more", special=True, seed=1)  # with BOS: another token sequence
    assert store.stats.reused == 0
    store.encode(text + " more", special=False, seed=1)
    assert store.stats.reused == 1


def test_bounded_and_keeps_no_text(bos_tokenizer: tokenizers.Tokenizer) -> None:
    store = _store(bos_tokenizer, PrefixStoreOptions(stride=256, margin=32, overlap=4,
                                                     fine=64, max_segments=10))
    rng = random.Random(6)
    for _ in range(8):
        store.encode(_text(rng, 300), special=False, seed=1)
    assert len(store) == 10
    assert store.stats.evicted == store.stats.stored - 10 > 0
    for seg in store._segments.values():
        assert isinstance(seg.keys, array)
        assert all(isinstance(v, int) for v in (seg.start, seg.end, seg.tokens, *seg.tail_ids,
                                                *seg.tail_starts))


async def test_the_gateway_tokenizer_reuses_a_sessions_turns(
    make_tokenizer: MakeTokenizer,
) -> None:
    whole = make_tokenizer(threads=1, prefix_store=PrefixStoreOptions(max_segments=0))
    tok = make_tokenizer(threads=1)
    rng = random.Random(7)
    messages = [{"role": "system", "content": _text(rng, 800)}]
    for _turn in range(4):
        messages.append({"role": "user", "content": _text(rng, 30)})
        for chat in (True, False):
            body = ({"messages": messages} if chat
                    else {"prompt": "".join(m["content"] for m in messages)})
            got = await tok.key(body, chat=chat, salt="tenant")
            want = await whole.key(body, chat=chat, salt="tenant")
            assert got is not None
            assert got == want
        messages.append({"role": "assistant", "content": _text(rng, 20)})
    assert tok.prefixes.stats.reused == 6
    assert whole.prefixes.stats.reused == 0


async def test_short_prompts_are_keyed_on_the_loop(make_tokenizer: MakeTokenizer) -> None:
    inline, pooled = make_tokenizer(inline_chars=100), make_tokenizer(inline_chars=0)
    short = {"prompt": "Where is my invoice for last month?"}
    got = await inline.key(short, chat=False, salt="t")
    assert got is not None
    assert got == await pooled.key(short, chat=False, salt="t")
    assert not inline._pool._threads  # no thread was needed
    assert pooled._pool._threads
    long = {"prompt": "billing " * 50}  # over 100 characters: the pool
    assert await inline.key(long, chat=False, salt="t") == await pooled.key(
        long, chat=False, salt="t")
    assert inline._pool._threads
    assert inline.stats.prompts == 2


async def test_metrics_say_what_the_store_saved(make_tokenizer: MakeTokenizer) -> None:
    tok = make_tokenizer(threads=1)
    registry = CollectorRegistry()
    registry.register(TokenizerCollector(tok))
    context = _text(random.Random(8), 600, WORDS[:-2])
    for turn in ("first question", "second question"):
        context += turn
        assert await tok.key({"prompt": context}, chat=False, salt="t") is not None

    def value(name: str) -> float:
        sample = registry.get_sample_value(name)
        assert sample is not None
        return sample

    assert value("gateway_tokenize_prompts_total") == 2
    assert value("gateway_tokenize_reused_tokens_total") == tok.prefixes.stats.reused_tokens
    assert 0 < value("gateway_tokenize_reused_tokens_total") < value(
        "gateway_tokenize_tokens_total")
    assert value("gateway_tokenize_prefix_segments") == len(tok.prefixes) > 0
    assert value("gateway_tokenize_prefix_mismatches_total") == 0


def _pieced(tok: tokenizers.Tokenizer) -> TokenPrefixStore:
    return TokenPrefixStore(
        lambda text, special: tok.encode_batch([text], add_special_tokens=special)[0], BLOCK,
        PrefixStoreOptions(stride=256, margin=32, overlap=4, fine=64, chunk_chars=1024),
        encode_many=lambda texts, special: tok.encode_batch(texts, add_special_tokens=special))


@pytest.mark.parametrize("special", [False, True])
def test_a_long_first_prompt_is_encoded_in_pieces_with_exact_keys(
    bos_tokenizer: tokenizers.Tokenizer, special: bool
) -> None:
    rng = random.Random(9)
    for words in (WORDS, WORDS[:-2]):
        store = _pieced(bos_tokenizer)
        text = _text(rng, 3000, words)  # ~20 pieces, joined in text of every kind
        out = store.encode(text, special=special, seed=5)
        assert out.keys == _whole(bos_tokenizer, text, special, 5)
        assert out.tokens == len(bos_tokenizer.encode(text, add_special_tokens=special).ids)
        assert store.stats.pieced == 1
        # Its segments serve the next turn as any others.
        text += _text(rng, 40, words)
        assert store.encode(text, special=special, seed=5).keys == _whole(
            bos_tokenizer, text, special, 5)
        assert store.stats.reused == 1


def test_pieces_that_never_agree_are_encoded_whole() -> None:
    # The marker normalizer puts a token in front of every piece: neighbours never agree.
    rng = random.Random(10)
    tok = _trained(pre_tokenizers.Whitespace(), normalizers.Prepend("#"), rng)
    store = _pieced(tok)
    text = _text(rng, 2000)
    assert store.encode(text, special=False, seed=1).keys == _whole(tok, text, False, 1)
    assert store.stats.pieced == 0
    assert store.stats.mismatches == 1


@pytest.mark.parametrize("special", [False, True])
def test_a_long_new_text_after_a_known_prefix_is_encoded_in_pieces(
    bos_tokenizer: tokenizers.Tokenizer, special: bool
) -> None:
    rng = random.Random(11)
    store = _pieced(bos_tokenizer)
    system = _text(rng, 200)  # a shared prompt seen before
    store.encode(system, special=special, seed=2)
    pieced = store.stats.pieced
    document = system + _text(rng, 3000)  # then a long text of its own
    out = store.encode(document, special=special, seed=2)
    assert out.keys == _whole(bos_tokenizer, document, special, 2)
    assert (store.stats.reused, store.stats.pieced - pieced) == (1, 1)
    follow_up = document + _text(rng, 30)
    assert store.encode(follow_up, special=special, seed=2).keys == _whole(
        bos_tokenizer, follow_up, special, 2)
    assert store.stats.reused == 2
