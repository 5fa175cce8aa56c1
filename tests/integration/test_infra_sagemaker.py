"""``python -m infra sagemaker ...`` with real boto3 against moto's server, and a gateway that
reads the registered variants from Redis and invokes them through moto's ``InvokeEndpoint``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import boto3
import openai
import pytest
from botocore.exceptions import ClientError
from moto.server import ThreadedMotoServer

from gateway.store.redis import RedisStore
from infra.__main__ import main
from infra.sagemaker_image import resolve_lmi_image, sdk_retrieve
from tests.conftest import MODEL, RedisServer, StartCluster, free_port
from tests.sagemaker_server import aws_test_env

ROLE = "arn:aws:iam::123456789012:role/sagemaker-execution"


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in aws_test_env().items():
            mp.setenv(name, value)
        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.stop()


@pytest.fixture
def moto(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in aws_test_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    urllib.request.urlopen(urllib.request.Request(moto_url + "/moto-api/reset", method="POST"),
                           timeout=10).close()
    return moto_url


def sm(url: str, service: str = "sagemaker") -> Any:
    return boto3.client(service, region_name="us-east-1", endpoint_url=url)


def cli(url: str, *argv: str) -> int:
    action, *rest = argv
    return main(["sagemaker", action, "--name", "llm", "--region", "us-east-1",
                 "--endpoint-url", url, *rest])


def deploy(url: str, *extra: str) -> int:
    return cli(url, "deploy", "--role-arn", ROLE, "--model-id", "Qwen/Qwen2.5-7B-Instruct",
               "--variants", "2", "--instances", "2", "--poll-s", "0",
               # moto knows an older list of instance types than the API (no ml.g5/g6 yet)
               "--instance-type", "ml.g4dn.xlarge", *extra)


def test_deploy_scale_weights_autoscale_status_teardown(
    moto: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert deploy(moto, "--prefix-length", "2048", "--env", "OPTION_MAX_MODEL_LEN=8192") == 0
    out = capsys.readouterr().out
    assert "endpoint llm: InService" in out
    client = sm(moto)
    described = client.describe_endpoint(EndpointName="llm")
    config = client.describe_endpoint_config(EndpointConfigName=described["EndpointConfigName"])
    variants = config["ProductionVariants"]
    assert [v["VariantName"] for v in variants] == ["v1", "v2"]
    assert all(v["InitialInstanceCount"] == 2 for v in variants)
    assert variants[0]["RoutingConfig"] == {
        "RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {"PrefixLength": 2048}}
    container = client.describe_model(ModelName="llm-model")["PrimaryContainer"]
    assert container["Image"] == resolve_lmi_image("us-east-1").uri
    assert f"llm-model: {container['Image']}" in out
    env = container["Environment"]
    assert env["OPTION_ENABLE_PREFIX_CACHING"] == "true"
    assert env["OPTION_ROLLING_BATCH"] == "vllm"
    assert env["OPTION_MAX_MODEL_LEN"] == "8192"

    assert cli(moto, "scale", "--variant", "v1", "--instances", "3") == 0
    assert cli(moto, "weights", "v1=3", "v2=1") == 0
    assert cli(moto, "autoscale", "--variant", "v2", "--min", "1", "--max", "4") == 0
    capsys.readouterr()
    assert cli(moto, "status", "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert status["status"] == "InService"
    assert {v["variant"]: (v["instances"], v["weight"]) for v in status["variants"]} == {
        "v1": (3, 3.0), "v2": (2, 1.0)}
    scaling = sm(moto, "application-autoscaling")
    (target,) = scaling.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"]
    assert (target["ResourceId"], target["MinCapacity"], target["MaxCapacity"]) == (
        "endpoint/llm/variant/v2", 1, 4)
    (policy,) = scaling.describe_scaling_policies(ServiceNamespace="sagemaker")["ScalingPolicies"]
    tracking = policy["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["PredefinedMetricSpecification"]["PredefinedMetricType"] == (
        "SageMakerVariantInvocationsPerInstance")

    assert cli(moto, "teardown") == 0
    with pytest.raises(ClientError):
        client.describe_endpoint(EndpointName="llm")
    assert client.list_models()["Models"] == []
    assert scaling.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"] == []


def test_deploy_uses_an_image_given_as_given(moto: str) -> None:
    assert deploy(moto, "--image", "registry.example/{region}/lmi:1") == 0
    container = sm(moto).describe_model(ModelName="llm-model")["PrimaryContainer"]
    assert container["Image"] == "registry.example/us-east-1/lmi:1"


def test_deploy_of_another_lmi_version_without_the_sdk_asks_for_the_image(
    moto: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if sdk_retrieve() is not None:
        pytest.skip("the sagemaker SDK is installed: it resolves the version")
    assert deploy(moto, "--lmi-version", "0.38.0") == 1
    assert "pass --image for LMI 0.38.0" in capsys.readouterr().err
    with pytest.raises(ClientError):
        sm(moto).describe_model(ModelName="llm-model")  # nothing created


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["scale", "--variant", "v9", "--instances", "2"], "no variant v9",
                     id="unknown-variant"),
        pytest.param(["weights", "v1"], "VARIANT=WEIGHT", id="bad-weight"),
        pytest.param(["status"], "Could not find endpoint", id="no-endpoint"),
    ],
)
def test_mistakes_are_one_line_errors(
    moto: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    if argv[0] != "status":
        assert deploy(moto) == 0
    assert cli(moto, *argv) == 1
    assert message in capsys.readouterr().err


async def test_registered_variants_are_routed_through_invoke_endpoint(
    moto: str, redis_server: RedisServer, start_cluster: StartCluster
) -> None:
    assert await asyncio.to_thread(deploy, moto) == 0
    assert await asyncio.to_thread(
        cli, moto, "register", "--store", redis_server.url, "--model", MODEL,
        "--blocks-per-instance", "1000") == 0
    store = RedisStore(redis_server.url)
    await store.start()
    try:
        records = sorted(await store.list_workers(), key=lambda r: r.id)
    finally:
        await store.close()
    assert [(r.id, r.kind, r.models, r.capacity_blocks) for r in records] == [
        ("sm:us-east-1/llm/v1", "sagemaker", (MODEL,), 2000),
        ("sm:us-east-1/llm/v2", "sagemaker", (MODEL,), 2000)]
    assert records[0].url.startswith("sagemaker://llm?variant=v1&region=us-east-1&endpoint_url=")

    reply = {"id": "chatcmpl-moto", "object": "chat.completion", "created": 0, "model": MODEL,
             "choices": [{"index": 0, "finish_reason": "stop",
                          "message": {"role": "assistant", "content": "from moto"}}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    queue = {"results": [{"Body": json.dumps(reply), "ContentType": "application/json",
                          "InvokedProductionVariant": "v1"}]}
    request = urllib.request.Request(
        moto + "/moto-api/static/sagemaker/endpoint-results", data=json.dumps(queue).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=10).close())

    cluster = await start_cluster(workers=0, store=redis_server.url)
    async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key="k", max_retries=0) as oa:
        raw = await oa.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.parse().choices[0].message.content == "from moto"
    assert raw.headers["x-route-worker"] in {r.id for r in records}

    assert await asyncio.to_thread(cli, moto, "teardown", "--store", redis_server.url) == 0
    store = RedisStore(redis_server.url)
    await store.start()
    try:
        assert await store.list_workers() == []
    finally:
        with contextlib.suppress(Exception):
            await store.close()
