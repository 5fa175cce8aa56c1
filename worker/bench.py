"""Time to first token on a prefix-cache miss vs a hit, on the real torch engine (not a test).

    python -m worker.bench --engine torch --prefix-tokens 2000 --suffix-tokens 50 --json

Each trial draws a fresh random prefix P (so the first request is a true miss) and runs, through
the engine's async API exactly as the HTTP server does:

1. miss: ``P + S1`` (nothing cached: prefill computes every position);
2. hit:  ``P + S2`` (a different suffix: the blocks of P are reused, only the rest is computed).

TTFT = admission (block allocation) + prefill + first token, measured on the event loop. Misses
and hits alternate, and the reported values are medians over ``--trials``. One untimed warm-up
request runs first. Also reported: decode tokens/s (greedy, after a hit), KV bytes per token for
float32/bfloat16/int8 for this model shape, and the int8 KV cache's max relative logit error
(``max|logits_int8 - logits_fp| / max|logits_fp|``) on the hit prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from worker.engines.base import GenerationRequest
from worker.engines.torch_engine import TorchEngine, TorchEngineConfig
from worker.model import KVPool
from worker.settings import DEVICES, KV_DTYPES, MODEL_DTYPES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("torch",), default="torch")
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--suffix-tokens", type=int, default=50)
    p.add_argument("--trials", type=int, default=3, help="miss/hit pairs (medians reported)")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--model-config", default="bench",
                   help="preset (tiny, small, bench, gpu) or ModelConfig JSON path")
    p.add_argument("--model-weights", default="")
    p.add_argument("--model-seed", type=int, default=0)
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--model-dtype", choices=MODEL_DTYPES, default="float32")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=1, help="seed of the random prompts")
    p.add_argument("--no-int8-check", action="store_true",
                   help="skip measuring the int8 KV logit error")
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    return p


async def _ttft(engine: TorchEngine, rid: str, tokens: Sequence[int],
                max_tokens: int = 1) -> tuple[float, int, float]:
    """(TTFT seconds, matched tokens, decode seconds of the remaining tokens)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    ttft = 0.0
    t1 = t0
    request = GenerationRequest(rid, list(tokens), max_tokens)
    async with engine.admit(request) as gen:
        matched = gen.admission.matched_tokens
        count = 0
        async for _piece in gen.tokens():
            count += 1
            if count == 1:
                ttft = loop.time() - t0
                t1 = loop.time()
        decode = loop.time() - t1
    return ttft, matched, decode


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def int8_error(engine: TorchEngine, tokens: Sequence[int]) -> float:
    """Max relative logit error of an int8 KV pool vs a full-precision one, full prefill.

    The reference pool stores K/V in the engine's KV dtype, or in its compute dtype when the
    engine itself runs an int8 pool (comparing int8 with int8 would always read 0).
    """
    runner = engine.runner
    cfg = runner.model.cfg
    bs = engine.cache.block_size
    blocks = -(-len(tokens) // bs)
    table = torch.arange(blocks, device=runner.device)
    outputs = []
    reference = engine.pool.kv_dtype
    if reference == "int8":
        reference = str(engine.pool.compute_dtype).removeprefix("torch.")
    for kv in (reference, "int8"):
        pool = KVPool(blocks, bs, cfg, dtype=kv, compute_dtype=engine.pool.compute_dtype,
                      device=runner.device)
        outputs.append(type(runner)(runner.model, pool).full_prefill(tokens, table))
    ref, q = outputs
    return float((q - ref).abs().max() / ref.abs().max())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    per_request = args.prefix_tokens + args.suffix_tokens + args.decode_tokens
    blocks = (-(-per_request // args.block_size) + 1) * (2 * args.trials + 3)
    config = TorchEngineConfig(
        model_config=args.model_config, model_weights=args.model_weights,
        model_seed=args.model_seed, device=args.device, model_dtype=args.model_dtype,
        kv_dtype=args.kv_dtype, block_size=args.block_size, cache_blocks=blocks, max_running=1,
    )
    engine = TorchEngine.build(config, detokenize=str)
    try:
        cfg = engine.runner.model.cfg
        rng = random.Random(args.seed)

        def draw(n: int) -> list[int]:
            return [rng.randrange(cfg.vocab_size) for _ in range(n)]

        await _ttft(engine, "warmup", draw(4 * args.block_size + 3), max_tokens=2)
        misses: list[float] = []
        hits: list[float] = []
        matched_hit = 0
        hit_prompt: list[int] = []
        for i in range(args.trials):
            prefix = draw(args.prefix_tokens)
            miss_s, miss_matched, _ = await _ttft(engine, f"miss{i}",
                                                  prefix + draw(args.suffix_tokens))
            assert miss_matched == 0, "a miss trial found cached blocks"
            hit_prompt = prefix + draw(args.suffix_tokens)
            hit_s, matched_hit, _ = await _ttft(engine, f"hit{i}", hit_prompt)
            misses.append(miss_s)
            hits.append(hit_s)
        decode_prompt = hit_prompt[: args.prefix_tokens] + draw(args.suffix_tokens)
        _, _, decode_s = await _ttft(engine, "decode", decode_prompt,
                                     max_tokens=args.decode_tokens)
        _sync(engine.pool.device)
        miss, hit = statistics.median(misses), statistics.median(hits)
        result: dict[str, Any] = {
            "engine": "torch",
            "device": str(engine.pool.device),
            "device_name": (torch.cuda.get_device_name(engine.pool.device)
                            if engine.pool.device.type == "cuda" else "cpu"),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "model_config": args.model_config,
            "model": engine.info()["model"],
            "model_params": engine.runner.model.num_params(),
            "non_embedding_params": engine.runner.model.num_params()
            - cfg.vocab_size * cfg.hidden_size,
            "model_dtype": args.model_dtype,
            "kv_dtype": engine.pool.kv_dtype,
            "block_size": args.block_size,
            "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens,
            "trials": args.trials,
            "ttft_miss_s": round(miss, 6),
            "ttft_hit_s": round(hit, 6),
            "ratio": round(miss / hit, 3) if hit > 0 else None,
            "ttft_miss_trials_s": [round(x, 6) for x in misses],
            "ttft_hit_trials_s": [round(x, 6) for x in hits],
            "matched_tokens_hit": matched_hit,
            "decode_tokens": args.decode_tokens,
            "decode_tokens_per_s": (round((args.decode_tokens - 1) / decode_s, 2)
                                    if args.decode_tokens > 1 and decode_s > 0 else None),
            "kv_bytes_per_token": {
                dt: cfg.kv_bytes_per_token(dt, args.block_size)
                for dt in ("float32", "bfloat16", "int8")
            },
        }
        if not args.no_int8_check:
            result["int8_max_rel_logit_error"] = round(int8_error(engine, hit_prompt), 6)
        return result
    finally:
        engine.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if min(args.prefix_tokens, args.suffix_tokens, args.trials, args.decode_tokens,
           args.block_size) < 1:
        print("python -m worker.bench: error: counts must be >= 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = asyncio.run(run(args))
    result["wall_s"] = round(time.perf_counter() - started, 2)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
