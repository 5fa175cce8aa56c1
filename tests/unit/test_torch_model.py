"""The torch decoder on the paged pool: prefix reuse must not change a single logit (float32, CPU).

Every check compares against a full recompute of the same prompt in a fresh pool.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (optional extra: pip install '.[torch]')"
)

from torch import Tensor  # noqa: E402 (after importorskip)

from worker.engines.torch_engine import ModelRunner  # noqa: E402
from worker.kvcache import PrefixCache  # noqa: E402
from worker.model import (  # noqa: E402
    PRESETS,
    KVPool,
    ModelConfig,
    ModelLoadError,
    Transformer,
)

pytestmark = pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")

BS = 16
CFG = PRESETS["tiny"]
ATOL = 1e-4
# Measured max relative logit error here (prefill + 8 decode steps, 6 prompts): int8 0.0028,
# bfloat16 0.0006. The bench model (43M params, 2050 tokens) measures int8 at 0.0099.
INT8_BOUND = 0.01


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny ops: OpenMP threads cost more than they give, especially on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> Transformer:
    built = Transformer.random(CFG, seed=0)
    built.eval()
    return built


def runner(model: Transformer, blocks: int, kv: str = "float32") -> ModelRunner:
    pool = KVPool(blocks, BS, model.cfg, dtype=kv, compute_dtype=torch.float32,
                  device=torch.device("cpu"))
    return ModelRunner(model, pool)


def reference(model: Transformer, tokens: list[int]) -> Tensor:
    """Logits after ``tokens``, computed from scratch in a private pool."""
    blocks = -(-len(tokens) // BS)
    return runner(model, blocks).full_prefill(tokens, torch.arange(blocks))


def draw(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(CFG.vocab_size) for _ in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_logits_with_prefix_reuse_equal_full_recompute(model: Transformer, seed: int) -> None:
    rng = random.Random(seed)
    cache = PrefixCache(num_blocks=64, block_size=BS)
    run = runner(model, 64)
    # Shared prefixes of random lengths, including exact block boundaries and full hits.
    base = draw(rng, 90)
    lengths = [rng.randrange(1, 90), 32, 48, rng.randrange(17, 80)]
    prompts = [base[:n] + draw(rng, rng.randrange(0, 20)) for n in lengths]
    prompts += [base[:64], base[:64] + draw(rng, 5), base[:33]]  # full hit, +partial, 1 past
    hits = 0
    for i, tokens in enumerate(prompts):
        if not tokens:
            continue
        alloc = cache.allocate(f"r{i}", tokens)
        hits += alloc.matched_tokens
        got = run.prefill(alloc, tokens, run.table(alloc))
        cache.release(f"r{i}")
        torch.testing.assert_close(got, reference(model, tokens), atol=ATOL, rtol=0)
    assert hits > 0


def test_full_hit_recomputes_only_the_last_token(model: Transformer) -> None:
    cache = PrefixCache(num_blocks=8, block_size=BS)
    run = runner(model, 8)
    tokens = draw(random.Random(7), 3 * BS)  # exactly three full blocks
    first = cache.allocate("a", tokens)
    run.prefill(first, tokens, run.table(first))
    cache.release("a")
    before = run.pool.data.clone()
    again = cache.allocate("b", tokens)
    assert again.matched_tokens == len(tokens)
    got = run.prefill(again, tokens, run.table(again))
    # Nothing rewritten, bit for bit. The pool is allocated uninitialized, and its unused
    # slots may hold NaN patterns, which torch.equal never calls equal.
    assert torch.equal(run.pool.data.view(torch.int32), before.view(torch.int32))
    torch.testing.assert_close(got, reference(model, tokens), atol=ATOL, rtol=0)


def test_reuse_after_evictions_still_matches(model: Transformer) -> None:
    rng = random.Random(3)
    cache = PrefixCache(num_blocks=10, block_size=BS)  # small: constant eviction
    run = runner(model, 10)
    prefixes = [draw(rng, rng.randrange(20, 70)) for _ in range(4)]
    for i in range(24):
        tokens = rng.choice(prefixes) + draw(rng, rng.randrange(0, 30))
        tokens = tokens[: 10 * BS]
        alloc = cache.allocate(f"r{i}", tokens)
        got = run.prefill(alloc, tokens, run.table(alloc))
        cache.release(f"r{i}")
        torch.testing.assert_close(got, reference(model, tokens), atol=ATOL, rtol=0)
    assert cache.evicted_blocks > 0
    assert cache.hit_tokens > 0


def test_decode_appends_match_full_recompute(model: Transformer) -> None:
    tokens = draw(random.Random(5), 29)
    cache = PrefixCache(num_blocks=8, block_size=BS)
    run = runner(model, 8)
    alloc = cache.allocate("a", tokens, reserve_tokens=20)
    table = run.table(alloc)
    logits = run.prefill(alloc, tokens, table)
    seq = list(tokens)
    for _ in range(20):  # crosses the boundary into the reserved blocks
        nxt = int(torch.argmax(logits))
        logits = run.decode(nxt, len(seq), table)
        seq.append(nxt)
        torch.testing.assert_close(logits, reference(model, seq), atol=ATOL, rtol=0)


def test_all_positions_of_one_pass_match(model: Transformer) -> None:
    tokens = draw(random.Random(11), 40)
    run = runner(model, 3)
    every = run.model.forward_chunk(
        torch.tensor(tokens), 0, torch.arange(3), run.pool, all_logits=True
    )
    for n in (1, 16, 17, 40):
        torch.testing.assert_close(every[n - 1], reference(model, tokens[:n]), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("kv", "bound"), [("int8", INT8_BOUND), ("bfloat16", INT8_BOUND)])
def test_quantized_kv_error_is_bounded(model: Transformer, kv: str, bound: float) -> None:
    rng = random.Random(9)
    cache = PrefixCache(num_blocks=32, block_size=BS)
    run = runner(model, 32, kv)
    prefix = draw(rng, 70)
    worst = 0.0
    for i in range(6):
        tokens = prefix[: rng.randrange(1, 70)] + draw(rng, rng.randrange(1, 40))
        alloc = cache.allocate(f"r{i}", tokens, reserve_tokens=8)
        table = run.table(alloc)
        logits = run.prefill(alloc, tokens, table)
        seq = list(tokens)
        for _ in range(8):  # decode appends re-derive partial blocks' scales
            ref = reference(model, seq)
            worst = max(worst, float((logits - ref).abs().max() / ref.abs().max()))
            seq.append(int(torch.argmax(ref)))
            logits = run.decode(seq[-1], len(seq) - 1, table)
        cache.release(f"r{i}")
    assert 0.0 < worst < bound


def test_int8_pool_takes_a_quarter_of_float32() -> None:
    fp = KVPool(8, BS, CFG, dtype="float32", compute_dtype=torch.float32,
                device=torch.device("cpu"))
    q = KVPool(8, BS, CFG, dtype="int8", compute_dtype=torch.float32,
               device=torch.device("cpu"))
    bf = KVPool(8, BS, CFG, dtype="bfloat16", compute_dtype=torch.float32,
                device=torch.device("cpu"))
    assert bf.nbytes * 2 == fp.nbytes
    assert fp.nbytes / 4 < q.nbytes < fp.nbytes / 4 * 1.1  # + one float32 scale per block/head
    assert q.bytes_per_token == CFG.kv_bytes_per_token("int8", BS)
    assert fp.bytes_per_token == CFG.kv_bytes_per_token("float32", BS)


def test_random_weights_are_deterministic() -> None:
    a, b = Transformer.random(CFG, 1), Transformer.random(CFG, 1)
    c = Transformer.random(CFG, 2)
    assert torch.equal(a.embed.weight, b.embed.weight)
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_config_presets_files_and_validation(tmp_path: Path) -> None:
    assert ModelConfig.load("tiny") == CFG
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"hidden_size": 32, "num_heads": 4, "num_kv_heads": 1,
                                "num_layers": 1, "vocab_size": 100}))
    cfg = ModelConfig.load(str(path))
    assert (cfg.head_dim, cfg.num_kv_heads) == (8, 1)
    with pytest.raises(ModelLoadError, match="neither a preset"):
        ModelConfig.load("no-such-model")
    path.write_text(json.dumps({"hidden_size": 30, "num_heads": 4}))
    with pytest.raises(ModelLoadError, match="multiple of num_heads"):
        ModelConfig.load(str(path))
    path.write_text(json.dumps({"num_heads": 8, "num_kv_heads": 3}))
    with pytest.raises(ModelLoadError, match="num_kv_heads"):
        ModelConfig.load(str(path))
    path.write_text(json.dumps({"layers": 3}))
    with pytest.raises(ModelLoadError, match="unknown keys"):
        ModelConfig.load(str(path))


@pytest.mark.skipif(importlib.util.find_spec("safetensors") is not None,
                    reason="safetensors is installed")
def test_weights_without_safetensors_give_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="needs the optional 'safetensors' package"):
        Transformer.from_safetensors(CFG, str(tmp_path / "w.safetensors"))


def test_safetensors_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("safetensors", reason="the optional 'safetensors' package is missing")
    model = Transformer.random(CFG, 4)
    path = str(tmp_path / "w.safetensors")
    model.save_safetensors(path)
    loaded = Transformer.from_safetensors(CFG, path)
    expected = model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(ModelLoadError, match="do not match"):
        Transformer.from_safetensors(PRESETS["small"], path)
