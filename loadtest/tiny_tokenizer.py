"""A small byte-level BPE ``tokenizer.json``, trained locally (no download) for tests and the
live benchmarks: the reference worker and the gateway load the same file, as a vLLM server and
a gateway in front of it load the served model's tokenizer.

``python -m loadtest.tiny_tokenizer OUT.json [--vocab-size 800] [--bos "<s>"]``

The corpus is generated from the workload vocabulary (:mod:`loadtest.workloads`) and the
reference chat template's markers, so benchmark prompts tokenize at a realistic 3-5 characters
per token; byte-level pre-tokenization means any text tokenizes. Training is deterministic.
With ``--bos``, the tokenizer has a BOS special token that its post-processor prepends when
special tokens are asked for (as Llama-family tokenizers do for completion prompts).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from loadtest.workloads import VOCABULARY, system_prompt

_MARKERS = ("<|system|>\n", "<|user|>\n", "<|assistant|>\n", "<|end|>\n", "<|tool_calls|>")


def _corpus(seed: int = 7) -> Iterator[str]:
    rng = random.Random(seed)
    for tenant in range(16):
        yield system_prompt(seed, tenant, (1500, 3000))
    for _ in range(400):
        words = " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(5, 30)))
        yield f"{rng.choice(_MARKERS)}{words.capitalize()}.{rng.choice(_MARKERS)}"


def train(path: Path, vocab_size: int = 800, bos: str = "") -> Path:
    """Train the tokenizer and write it to ``path``; returns ``path``. ``bos``: a BOS token
    that the post-processor adds in front of a sequence when special tokens are asked for."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[bos] if bos else [],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if bos:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.tiny_tokenizer", description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--vocab-size", type=int, default=800)
    p.add_argument("--bos", default="", help="a BOS special token, e.g. '<s>'")
    args = p.parse_args(argv)
    train(args.out, args.vocab_size, args.bos)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
