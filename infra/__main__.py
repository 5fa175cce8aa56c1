"""``python -m infra``: start and manage the workers the gateway routes to.

local serve                 N workers + a gateway in the foreground until Ctrl-C
local up|scale|down|status  detached workers that register in the store (gateway --store ...);
                            scale --gateway URL reports their warm-up until they serve
sagemaker deploy|scale|weights|autoscale|status|register|teardown
                            SageMaker real-time endpoints (boto3; AWS credentials as usual)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from gateway.backends.sagemaker_target import SageMakerTarget
from gateway.store.base import StoreUnavailable
from infra import local_detached, sagemaker, warming
from infra.local import DEFAULT_POLICY, LocalCluster, serve
from infra.sagemaker import ROUTING_STRATEGIES
from infra.sagemaker_image import DEFAULT_LMI_VERSION

_FMT = argparse.ArgumentDefaultsHelpFormatter


def _follow_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", default="",
                        help="a gateway URL: report the new workers' warm-up until they serve")
    parser.add_argument("--gateway-token", default="",
                        help="bearer token for the gateway's /admin endpoints, if it needs one")
    parser.add_argument("--warmup-timeout-s", type=float, default=120.0,
                        help="stop reporting warm-up after this long")


def _follow(args: argparse.Namespace, worker_ids: list[str]) -> int:
    """With --gateway: print the warm-up progress of ``worker_ids``; 1 if it did not finish."""
    if not args.gateway or not worker_ids:
        return 0
    done = asyncio.run(warming.follow(args.gateway, worker_ids, token=args.gateway_token,
                                      timeout_s=args.warmup_timeout_s))
    return 0 if done else 1


def _local_parser(targets: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    local = targets.add_parser("local", help="workers as processes on this machine")
    actions = local.add_subparsers(dest="action", required=True)
    run = actions.add_parser(
        "serve", help="run N workers and a gateway in the foreground until Ctrl-C",
        formatter_class=_FMT,
    )
    run.add_argument("--workers", type=int, default=4, help="number of reference workers")
    run.add_argument("--host", default="127.0.0.1", help="address for all servers")
    run.add_argument("--port", type=int, default=8000, help="gateway port")
    run.add_argument("--worker-base-port", type=int, default=8001,
                     help="first worker port; worker i listens on base + i")
    run.add_argument("--policy", default=None,
                     help=f"gateway routing policy (default: the config file's, else "
                          f"{DEFAULT_POLICY})")
    run.add_argument("--gateway-config", default=None, metavar="FILE",
                     help="TOML settings file for the gateway (python -m gateway --config)")
    run.add_argument("--model", default="sim-model", help="model name the workers serve")
    run.add_argument("--cache-blocks", type=int, default=2048,
                     help="KV blocks per worker (per engine rank with --dp-size)")
    run.add_argument("--dp-size", type=int, default=1,
                     help="data-parallel engine ranks per worker, each routed to on its own")

    def detached(name: str, text: str) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=text, description=text, formatter_class=_FMT)
        p.add_argument("--run-dir", type=Path, default=Path(".run"),
                       help="where the state file (local.json) and worker logs live")
        return p

    up = detached("up", "start N detached workers that register in the store")
    up.add_argument("--workers", type=int, default=4, help="number of reference workers")
    up.add_argument("--store", default="redis://127.0.0.1:6379/0",
                    help="metadata store the workers register in (start gateways with it)")
    up.add_argument("--host", default="127.0.0.1", help="address the workers listen on")
    up.add_argument("--model", default="sim-model", help="model name the workers serve")
    up.add_argument("--cache-blocks", type=int, default=2048,
                    help="KV blocks per worker (per engine rank with --dp-size)")
    up.add_argument("--dp-size", type=int, default=1,
                    help="data-parallel engine ranks per worker (registered with them)")
    sc = detached("scale", "start or stop detached workers until N run")
    sc.add_argument("workers", type=int, help="number of workers wanted")
    _follow_args(sc)
    detached("down", "stop every detached worker (each deregisters)")
    detached("status", "list the detached workers and their health")


def _sagemaker_parser(targets: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sm = targets.add_parser("sagemaker", help="SageMaker real-time endpoints (boto3)")
    actions = sm.add_subparsers(dest="action", required=True)

    def action(name: str, text: str) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=text, description=text, formatter_class=_FMT)
        p.add_argument("--name", required=True, help="endpoint name")
        p.add_argument("--region", default=None, help="AWS region (default: the SDK's)")
        p.add_argument("--endpoint-url", default=None,
                       help="another SageMaker API endpoint (VPC endpoint, tests)")
        return p

    deploy = action("deploy", "create model, endpoint config (K variants) and endpoint; "
                              "wait until InService")
    deploy.add_argument("--role-arn", required=True, help="SageMaker execution role")
    deploy.add_argument("--model-id", required=True, help="Hugging Face model id (HF_MODEL_ID)")
    deploy.add_argument("--image", default=None,
                        help="LMI vLLM container image URI ({region} is filled in); default: "
                             "the sagemaker SDK's URI for the region and --lmi-version")
    deploy.add_argument("--lmi-version", default=DEFAULT_LMI_VERSION,
                        help="LMI (DJL Serving) release when --image is not given")
    deploy.add_argument("--instance-type", default="ml.g5.2xlarge", help="instance type")
    deploy.add_argument("--variants", type=int, default=1, help="production variants (K)")
    deploy.add_argument("--instances", type=int, default=1, help="instances per variant")
    deploy.add_argument("--routing", default="PREFIX_AWARE", choices=ROUTING_STRATEGIES,
                        help="routing strategy inside each variant")
    deploy.add_argument("--prefix-length", type=int, default=0,
                        help="PREFIX_AWARE prefix length (1024-65536; 0 = service default)")
    deploy.add_argument("--concurrency-threshold", type=int, default=0,
                        help="PREFIX_AWARE concurrency threshold (1-1024; 0 = default)")
    deploy.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra container environment, e.g. OPTION_MAX_MODEL_LEN=8192")
    deploy.add_argument("--no-wait", action="store_true", help="return once creation started")
    deploy.add_argument("--poll-s", type=float, default=30.0, help="seconds between polls")
    deploy.add_argument("--timeout-s", type=float, default=3600.0, help="give up after this")

    scale = action("scale", "set a variant's instance count")
    scale.add_argument("--variant", required=True, help="variant name")
    scale.add_argument("--instances", type=int, required=True, help="instances wanted")
    _follow_args(scale)

    weights = action("weights", "set variant weights (traffic share without TargetVariant)")
    weights.add_argument("weights", nargs="+", metavar="VARIANT=WEIGHT")

    auto = action("autoscale", "target tracking on invocations per instance for a variant")
    auto.add_argument("--variant", required=True, help="variant name")
    auto.add_argument("--min", type=int, default=1, dest="min_instances", help="min instances")
    auto.add_argument("--max", type=int, required=True, dest="max_instances",
                      help="max instances")
    auto.add_argument("--invocations-per-instance", type=float, default=60.0,
                      help="target SageMakerVariantInvocationsPerInstance (per minute)")
    auto.add_argument("--scale-in-cooldown-s", type=int, default=300, help="scale-in cooldown")
    auto.add_argument("--scale-out-cooldown-s", type=int, default=60, help="scale-out cooldown")

    st = action("status", "endpoint status and its variants")
    st.add_argument("--json", action="store_true", help="print JSON")

    reg = action("register", "write each variant into the store as a gateway target")
    reg.add_argument("--store", required=True, help="redis://host:port/db of the gateways")
    reg.add_argument("--store-prefix", default="affinity", help="key prefix in the store")
    reg.add_argument("--model", action="append", default=[],
                     help="model name(s) the gateway advertises (default: the endpoint name)")
    reg.add_argument("--body", choices=("openai", "tgi"), default="openai",
                     help="request body shape the container takes")
    reg.add_argument("--sessions", action="store_true",
                     help="stateful sessions for hot prefixes (session=auto)")
    reg.add_argument("--runtime-endpoint-url", default=None,
                     help="runtime endpoint the gateways call (default: --endpoint-url)")
    reg.add_argument("--blocks-per-instance", type=int, default=0,
                     help="KV blocks per instance: ring weights follow instance counts")
    reg.add_argument("--ttl-s", type=float, default=7 * 24 * 3600.0,
                     help="the registration expires this long after the last register")

    down = action("teardown", "delete endpoint, its config and model (and its registrations)")
    down.add_argument("--store", default=None, help="also deregister its targets from here")
    down.add_argument("--store-prefix", default="affinity", help="key prefix in the store")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infra", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    targets = parser.add_subparsers(dest="target", required=True)
    _local_parser(targets)
    _sagemaker_parser(targets)
    return parser


def _local(args: argparse.Namespace) -> int:
    if args.action == "serve":
        if args.workers < 1 or args.dp_size < 1:
            print("python -m infra: --workers and --dp-size must be >= 1", file=sys.stderr)
            return 2
        cluster = LocalCluster(
            host=args.host, gateway_port=args.port, worker_base_port=args.worker_base_port,
            workers=args.workers, policy=args.policy or "", model=args.model,
            cache_blocks=args.cache_blocks, dp_size=args.dp_size,
            gateway_args=("--config", args.gateway_config) if args.gateway_config else (),
        )
        return asyncio.run(serve(cluster))
    if args.action == "up":
        ranks = ["--data-parallel-size", str(args.dp_size)] if args.dp_size > 1 else []
        state = local_detached.up(args.run_dir, args.workers, store=args.store, host=args.host,
                                  model=args.model, cache_blocks=args.cache_blocks,
                                  worker_args=ranks)
        print(f"{len(state.workers)} worker(s) up, registered in {state.store}: "
              + ", ".join(w.url for w in state.workers))
        print(f"gateway: python -m gateway --store {state.store}")
    elif args.action == "scale":
        before = local_detached.load_state(args.run_dir)
        known = {w.pid for w in before.workers} if before is not None else set()
        state = local_detached.scale(args.run_dir, args.workers)
        print(f"{len(state.workers)} worker(s) running", flush=True)
        new = [f"{state.host}:{w.port}" for w in state.workers if w.pid not in known]
        return _follow(args, new)
    elif args.action == "down":
        print(f"stopped {local_detached.down(args.run_dir)} worker(s)")
    else:
        print(local_detached.status(args.run_dir))
    return 0


def _sagemaker(args: argparse.Namespace) -> int:
    infra = sagemaker.SageMakerInfra(region=args.region, endpoint_url=args.endpoint_url)
    if args.action == "deploy":
        env = []
        for item in args.env:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--env takes KEY=VALUE, got {item!r}")
            env.append((key, value))
        spec = sagemaker.DeploySpec(
            name=args.name, role_arn=args.role_arn, model_id=args.model_id, image=args.image,
            lmi_version=args.lmi_version,
            instance_type=args.instance_type, variants=args.variants, instances=args.instances,
            routing=args.routing, prefix_length=args.prefix_length,
            concurrency_threshold=args.concurrency_threshold, env=tuple(env),
        )
        infra.deploy(spec, wait=not args.no_wait, poll_s=args.poll_s, timeout_s=args.timeout_s)
    elif args.action == "scale":
        infra.scale(args.name, args.variant, args.instances)
        target = SageMakerTarget(endpoint=args.name, variant=args.variant, region=infra.region)
        return _follow(args, [target.id])
    elif args.action == "weights":
        weights = {}
        for item in args.weights:
            variant, sep, weight = item.partition("=")
            if not sep:
                raise ValueError(f"weights are VARIANT=WEIGHT, got {item!r}")
            weights[variant] = float(weight)
        infra.set_weights(args.name, weights)
    elif args.action == "autoscale":
        infra.autoscale(
            args.name, args.variant, min_instances=args.min_instances,
            max_instances=args.max_instances,
            invocations_per_instance=args.invocations_per_instance,
            scale_in_cooldown_s=args.scale_in_cooldown_s,
            scale_out_cooldown_s=args.scale_out_cooldown_s,
        )
    elif args.action == "status":
        status = infra.status(args.name)
        print(sagemaker.status_json(status) if args.json else sagemaker.format_status(status))
    elif args.action == "register":
        sagemaker.register(
            infra, args.name, args.store, prefix=args.store_prefix, ttl_s=args.ttl_s,
            models=args.model, body=args.body, sessions=args.sessions,
            runtime_endpoint_url=args.runtime_endpoint_url,
            blocks_per_instance=args.blocks_per_instance,
        )
    else:
        infra.teardown(args.name)
        if args.store:
            gone = asyncio.run(
                sagemaker.deregister_endpoint(args.store, args.store_prefix, args.name))
            print(f"deregistered {', '.join(gone) or 'nothing'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _local(args) if args.target == "local" else _sagemaker(args)
    except (ValueError, RuntimeError, TimeoutError, OSError, ClientError, BotoCoreError,
            StoreUnavailable) as exc:
        print(f"python -m infra: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
