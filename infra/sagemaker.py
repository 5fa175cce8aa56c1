"""SageMaker real-time endpoints for the gateway: deploy, scale, weigh, autoscale, register.

Control plane with **boto3**: every step here is one documented API call (CreateModel,
CreateEndpointConfig with K ProductionVariants and their RoutingConfig, CreateEndpoint,
UpdateEndpointWeightsAndCapacities, Application Auto Scaling), which boto3 maps one to one, with
the same credential chain as the gateway's aiobotocore. The sagemaker SDK's Model/Predictor layer
hides exactly the fields we need (several variants per config, routing strategy, per-variant
weights) and adds nothing to test against (boto3 runs against moto's server unchanged); the SDK
(the optional ``sagemaker`` extra) is used for what it knows that boto3 does not, the LMI
container image of each region and release (:mod:`infra.sagemaker_image`).

``deploy`` creates the model (an LMI container running vLLM, prefix caching on:
``OPTION_ENABLE_PREFIX_CACHING=true``), an endpoint config with K variants and the endpoint, then
polls ``DescribeEndpoint`` with a progress line until InService. ``register`` writes each variant
into the metadata store as a ``sagemaker://`` target of kind ``sagemaker``, so every gateway
replica reading the store routes to it (with ring weights following instance counts when
``--blocks-per-instance`` is given). These are CLI functions: synchronous boto3 calls, never on an
event loop; the store write runs in its own short ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import boto3

from gateway.backends.sagemaker_target import SageMakerTarget
from gateway.store.base import WorkerRecord
from gateway.store.redis import RedisStore
from infra.sagemaker_image import DEFAULT_LMI_VERSION, resolve_lmi_image

ROUTING_STRATEGIES = ("PREFIX_AWARE", "LEAST_OUTSTANDING_REQUESTS", "RANDOM")
SERVING = ("InService",)


@dataclass(frozen=True, slots=True)
class DeploySpec:
    name: str
    role_arn: str
    model_id: str
    image: str | None = None  # None: the LMI image of lmi_version for the region (sagemaker_image)
    lmi_version: str = DEFAULT_LMI_VERSION
    instance_type: str = "ml.g5.2xlarge"
    variants: int = 1
    instances: int = 1
    routing: str = "PREFIX_AWARE"
    prefix_length: int = 0  # PREFIX_AWARE: 1,024-65,536; 0 = the service default
    concurrency_threshold: int = 0  # PREFIX_AWARE: 1-1,024; 0 = the service default
    env: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.variants < 1 or self.instances < 1:
            raise ValueError("--variants and --instances must be >= 1")
        if self.routing not in ROUTING_STRATEGIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_STRATEGIES)}")
        if self.prefix_length and not 1024 <= self.prefix_length <= 65536:
            raise ValueError("--prefix-length must be within 1,024-65,536")
        if self.concurrency_threshold and not 1 <= self.concurrency_threshold <= 1024:
            raise ValueError("--concurrency-threshold must be within 1-1,024")

    @property
    def model_name(self) -> str:
        return f"{self.name}-model"

    def variant_names(self) -> list[str]:
        return [f"v{i + 1}" for i in range(self.variants)]

    def container_env(self) -> dict[str, str]:
        env = {
            "HF_MODEL_ID": self.model_id,
            "OPTION_ROLLING_BATCH": "vllm",
            "OPTION_ENABLE_PREFIX_CACHING": "true",
            # Stable block hashes across restarts (vLLM seeds its hash chain from this).
            "PYTHONHASHSEED": "0",
        }
        env.update(dict(self.env))
        return env

    def routing_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"RoutingStrategy": self.routing}
        if self.routing == "PREFIX_AWARE":
            prefix: dict[str, int] = {}
            if self.prefix_length:
                prefix["PrefixLength"] = self.prefix_length
            if self.concurrency_threshold:
                prefix["ConcurrencyThreshold"] = self.concurrency_threshold
            if prefix:
                config["PrefixAwareRoutingConfig"] = prefix
        return config

    def production_variants(self) -> list[dict[str, Any]]:
        return [
            {
                "VariantName": variant,
                "ModelName": self.model_name,
                "InstanceType": self.instance_type,
                "InitialInstanceCount": self.instances,
                "InitialVariantWeight": 1.0,
                "RoutingConfig": self.routing_config(),
                "ContainerStartupHealthCheckTimeoutInSeconds": 900,
                "ModelDataDownloadTimeoutInSeconds": 1800,
            }
            for variant in self.variant_names()
        ]


class SageMakerInfra:
    def __init__(
        self,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        out: TextIO | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        session = boto3.session.Session(region_name=region)
        self.region = session.region_name or ""
        self.endpoint_url = endpoint_url or ""
        self.sm = session.client("sagemaker", endpoint_url=endpoint_url)
        self.autoscaling = session.client("application-autoscaling", endpoint_url=endpoint_url)
        self._out = out if out is not None else sys.stdout
        self._sleep = sleep
        self._clock = clock

    def _say(self, text: str) -> None:
        print(text, file=self._out, flush=True)

    # -- deploy / teardown ----------------------------------------------------------------------
    def deploy(self, spec: DeploySpec, *, wait: bool = True, poll_s: float = 30.0,
               timeout_s: float = 3600.0) -> dict[str, Any]:
        resolved = resolve_lmi_image(self.region, spec.lmi_version, image=spec.image)
        if resolved.note:
            self._say(f"image: {resolved.note}; using the built-in URI")
        image = resolved.uri
        self.sm.create_model(
            ModelName=spec.model_name,
            ExecutionRoleArn=spec.role_arn,
            PrimaryContainer={"Image": image, "Environment": spec.container_env()},
        )
        self._say(f"model {spec.model_name}: {image} ({resolved.source})")
        config = f"{spec.name}-config-{int(time.time())}"
        try:
            self.sm.create_endpoint_config(
                EndpointConfigName=config, ProductionVariants=spec.production_variants()
            )
        except Exception:
            self.sm.delete_model(ModelName=spec.model_name)  # leave nothing half-made behind
            raise
        self._say(f"endpoint config {config}: {spec.variants} variant(s) x {spec.instances} "
                  f"{spec.instance_type}, routing {spec.routing}")
        try:
            self.sm.create_endpoint(EndpointName=spec.name, EndpointConfigName=config)
        except Exception:
            self.sm.delete_endpoint_config(EndpointConfigName=config)
            self.sm.delete_model(ModelName=spec.model_name)
            raise
        self._say(f"endpoint {spec.name}: creating")
        if wait:
            return self.wait_in_service(spec.name, poll_s=poll_s, timeout_s=timeout_s)
        return dict(self.sm.describe_endpoint(EndpointName=spec.name))

    def wait_in_service(self, name: str, *, poll_s: float = 30.0,
                        timeout_s: float = 3600.0) -> dict[str, Any]:
        """Poll until InService, printing one progress line per change (and the elapsed time)."""
        started = self._clock()
        last = ""
        while True:
            described = dict(self.sm.describe_endpoint(EndpointName=name))
            status = str(described.get("EndpointStatus", ""))
            elapsed = self._clock() - started
            line = f"endpoint {name}: {status}"
            if line != last:
                self._say(f"{line} ({elapsed:.0f}s)")
                last = line
            if status in SERVING:
                return described
            if status == "Failed":
                raise RuntimeError(f"endpoint {name} failed: {described.get('FailureReason')}")
            if elapsed > timeout_s:
                raise TimeoutError(f"endpoint {name} not InService after {timeout_s:.0f}s")
            self._sleep(poll_s)

    def teardown(self, name: str) -> None:
        described = dict(self.sm.describe_endpoint(EndpointName=name))
        config = str(described["EndpointConfigName"])
        models = {
            str(v["ModelName"]) for v in
            self.sm.describe_endpoint_config(EndpointConfigName=config)["ProductionVariants"]
        }
        for variant in described.get("ProductionVariants", []):
            resource = f"endpoint/{name}/variant/{variant['VariantName']}"
            known = self.autoscaling.describe_scalable_targets(
                ServiceNamespace="sagemaker", ResourceIds=[resource]
            )["ScalableTargets"]
            if known:
                self.autoscaling.deregister_scalable_target(
                    ServiceNamespace="sagemaker", ResourceId=resource,
                    ScalableDimension="sagemaker:variant:DesiredInstanceCount",
                )
        self.sm.delete_endpoint(EndpointName=name)
        self._say(f"endpoint {name}: deleting")
        self.sm.get_waiter("endpoint_deleted").wait(
            EndpointName=name, WaiterConfig={"Delay": 5, "MaxAttempts": 360})
        self.sm.delete_endpoint_config(EndpointConfigName=config)
        for model in sorted(models):
            self.sm.delete_model(ModelName=model)
        self._say(f"deleted endpoint {name}, config {config}, model(s) {', '.join(sorted(models))}")

    # -- capacity -------------------------------------------------------------------------------
    def _variants(self, name: str) -> dict[str, dict[str, Any]]:
        described = self.sm.describe_endpoint(EndpointName=name)
        return {str(v["VariantName"]): dict(v) for v in described.get("ProductionVariants", [])}

    def _update(self, name: str, desired: Mapping[str, tuple[float | None, int | None]]) -> None:
        """Set weight and/or instance count per variant, keeping what is not given."""
        current = self._variants(name)
        unknown = set(desired) - set(current)
        if unknown:
            raise ValueError(f"endpoint {name} has no variant {', '.join(sorted(unknown))}; "
                             f"it has {', '.join(sorted(current))}")
        updates = []
        for variant, (weight, count) in desired.items():
            now = current[variant]
            updates.append({
                "VariantName": variant,
                "DesiredWeight": weight if weight is not None else float(
                    now.get("CurrentWeight", now.get("DesiredWeight", 1.0))),
                "DesiredInstanceCount": count if count is not None else int(
                    now.get("CurrentInstanceCount", now.get("DesiredInstanceCount", 1))),
            })
        self.sm.update_endpoint_weights_and_capacities(
            EndpointName=name, DesiredWeightsAndCapacities=updates
        )

    def scale(self, name: str, variant: str, instances: int) -> None:
        if instances < 1:
            raise ValueError("--instances must be >= 1 (teardown removes an endpoint)")
        self._update(name, {variant: (None, instances)})
        self._say(f"endpoint {name} variant {variant}: {instances} instance(s) requested")

    def set_weights(self, name: str, weights: Mapping[str, float]) -> None:
        if any(w < 0 for w in weights.values()):
            raise ValueError("weights must be >= 0")
        self._update(name, {v: (w, None) for v, w in weights.items()})
        self._say(f"endpoint {name} weights: "
                  + ", ".join(f"{v}={w:g}" for v, w in sorted(weights.items())))

    def autoscale(self, name: str, variant: str, *, min_instances: int, max_instances: int,
                  invocations_per_instance: float, scale_in_cooldown_s: int = 300,
                  scale_out_cooldown_s: int = 60) -> str:
        """Target tracking on ``SageMakerVariantInvocationsPerInstance``; returns the policy ARN."""
        if not 1 <= min_instances <= max_instances:
            raise ValueError("need 1 <= --min <= --max")
        if variant not in self._variants(name):
            raise ValueError(f"endpoint {name} has no variant {variant}")
        resource = f"endpoint/{name}/variant/{variant}"
        dimension = "sagemaker:variant:DesiredInstanceCount"
        self.autoscaling.register_scalable_target(
            ServiceNamespace="sagemaker", ResourceId=resource, ScalableDimension=dimension,
            MinCapacity=min_instances, MaxCapacity=max_instances,
        )
        policy = self.autoscaling.put_scaling_policy(
            PolicyName=f"{name}-{variant}-invocations",
            ServiceNamespace="sagemaker", ResourceId=resource, ScalableDimension=dimension,
            PolicyType="TargetTrackingScaling",
            TargetTrackingScalingPolicyConfiguration={
                "TargetValue": invocations_per_instance,
                "PredefinedMetricSpecification": {
                    "PredefinedMetricType": "SageMakerVariantInvocationsPerInstance"},
                "ScaleInCooldown": scale_in_cooldown_s,
                "ScaleOutCooldown": scale_out_cooldown_s,
            },
        )
        self._say(f"autoscaling {resource}: {min_instances}-{max_instances} instances, "
                  f"target {invocations_per_instance:g} invocations/instance/min")
        return str(policy["PolicyARN"])

    # -- views ----------------------------------------------------------------------------------
    def status(self, name: str) -> dict[str, Any]:
        described = dict(self.sm.describe_endpoint(EndpointName=name))
        return {
            "endpoint": name,
            "status": described.get("EndpointStatus"),
            "config": described.get("EndpointConfigName"),
            "variants": [
                {
                    "variant": v.get("VariantName"),
                    "instances": v.get("CurrentInstanceCount"),
                    "desired_instances": v.get("DesiredInstanceCount"),
                    "weight": v.get("CurrentWeight"),
                }
                for v in described.get("ProductionVariants", [])
            ],
        }

    def targets(
        self, name: str, *, models: Sequence[str] = (), body: str = "openai",
        sessions: bool = False, runtime_endpoint_url: str | None = None,
        blocks_per_instance: int = 0, block_size: int = 16,
    ) -> list[WorkerRecord]:
        """One gateway target per variant of the endpoint, as store records."""
        endpoint_url = self.endpoint_url if runtime_endpoint_url is None else runtime_endpoint_url
        records = []
        for variant, info in sorted(self._variants(name).items()):
            target = SageMakerTarget(
                endpoint=name, variant=variant, region=self.region, endpoint_url=endpoint_url,
                body=body, models=tuple(models), sessions=sessions,
            )
            instances = int(info.get("CurrentInstanceCount") or 0)
            records.append(WorkerRecord(
                id=target.id, url=target.url(), models=tuple(target.advertised_models()),
                capacity_blocks=blocks_per_instance * instances, block_size=block_size,
                kind="sagemaker",
            ))
        return records


async def register_records(store_url: str, prefix: str, records: Sequence[WorkerRecord],
                           ttl_s: float) -> None:
    store = RedisStore(store_url, prefix=prefix)
    await store.start()
    try:
        for record in records:
            await store.register_worker(record, ttl_s)
    finally:
        await store.close()


async def deregister_endpoint(store_url: str, prefix: str, endpoint: str) -> list[str]:
    """Remove every registered target of ``endpoint``; returns their ids."""
    store = RedisStore(store_url, prefix=prefix)
    await store.start()
    try:
        gone = [r.id for r in await store.list_workers()
                if r.kind == "sagemaker" and r.url.startswith(f"sagemaker://{endpoint}?")]
        for wid in gone:
            await store.deregister_worker(wid)
        return gone
    finally:
        await store.close()


def register(infra: SageMakerInfra, name: str, store_url: str, *, prefix: str, ttl_s: float,
             **target_options: Any) -> list[WorkerRecord]:
    records = infra.targets(name, **target_options)
    asyncio.run(register_records(store_url, prefix, records, ttl_s))
    for record in records:
        print(f"registered {record.id} -> {record.url}", file=infra._out, flush=True)
    return records


def format_status(status: Mapping[str, Any]) -> str:
    lines = [f"endpoint {status['endpoint']}: {status['status']} (config {status['config']})",
             f"  {'variant':<16} {'instances':>9} {'desired':>8} {'weight':>7}"]
    for v in status["variants"]:
        lines.append(f"  {v['variant']!s:<16} {v['instances']!s:>9} "
                     f"{v['desired_instances']!s:>8} {v['weight']!s:>7}")
    return "\n".join(lines)


def status_json(status: Mapping[str, Any]) -> str:
    return json.dumps(status, indent=2, default=str)
