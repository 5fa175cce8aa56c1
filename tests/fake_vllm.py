"""A stand-in for the ``vllm`` command: ``python -m tests.fake_vllm serve MODEL [flags]``.

It accepts the ``vllm serve`` flags the launcher passes, records its argument list and the
``PYTHONHASHSEED`` it saw (to the file named by ``FAKE_VLLM_RECORD``), and serves our reference
worker on the requested host and port. The reference worker speaks the same OpenAI API and
vLLM metric names, including ``vllm:cache_config_info``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from worker.__main__ import main as worker_main


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("model_path")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--enable-prefix-caching", action="store_true")
    serve.add_argument("--prefix-caching-hash-algo", default="builtin")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true")
    serve.add_argument("--max-model-len", type=int, default=32768)
    args = serve.parse_args(argv[1:]) if argv[:1] == ["serve"] else parser.parse_args(argv)
    record = os.environ.get("FAKE_VLLM_RECORD")
    if record:
        with open(record, "w", encoding="utf-8") as f:
            json.dump({"argv": argv, "pythonhashseed": os.environ.get("PYTHONHASHSEED")}, f)
    return worker_main([
        "--host", args.host, "--port", str(args.port),
        "--model", args.served_model_name or args.model_path,
        "--max-model-len", str(args.max_model_len), "--cache-blocks", "777",
    ])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
