"""The Kubernetes examples (``infra/k8s/``) agree with each other and with the code: the
gateway's arguments parse, its selector and port name find the vLLM pods, its account may
list and watch them, and the vLLM pods run with what routing relies on."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

from gateway.discovery import pod_worker
from gateway.settings import parse_settings

K8S = Path(__file__).resolve().parents[2] / "infra" / "k8s"


def _docs(name: str) -> dict[str, dict[str, Any]]:
    with (K8S / name).open() as f:
        return {d["kind"]: d for d in yaml.safe_load_all(f) if d}


def _gateway_container() -> dict[str, Any]:
    pod = _docs("gateway.yaml")["Deployment"]["spec"]["template"]["spec"]
    container: dict[str, Any] = pod["containers"][0]
    return container


def test_the_gateway_arguments_parse_and_find_the_vllm_pods() -> None:
    container = _gateway_container()
    args = container["args"]
    assert args[:3] == ["python", "-m", "gateway"]
    env = {e["name"]: e["value"] for e in container.get("env", ())}
    settings = parse_settings(args[3:], environ=env)
    vllm = _docs("vllm.yaml")["Deployment"]["spec"]["template"]
    labels = vllm["metadata"]["labels"]
    for term in settings.k8s_selector.split(","):
        key, value = term.split("=")
        assert labels[key] == value
    # A ready pod of that template is a worker at its named port, with its KV-event feeds.
    pod = copy.deepcopy(vllm)
    pod["status"] = {"phase": "Running", "podIP": "10.0.0.7",
                     "conditions": [{"type": "Ready", "status": "True"}]}
    options = settings.kubernetes_options()
    assert options is not None
    worker = pod_worker(pod, options)
    assert worker is not None
    assert worker.url == "vllm+http://10.0.0.7:8000"
    assert worker.events is not None
    assert worker.events.events == "tcp://10.0.0.7:5557"
    assert worker.events.replay == "tcp://10.0.0.7:5558"
    # The keys file the gateway reads is mounted from the Secret.
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(Path(settings.api_keys_file).parent) in mounts


def test_the_gateway_account_may_list_and_watch_pods() -> None:
    docs = _docs("gateway.yaml")
    account = docs["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"]
    assert docs["ServiceAccount"]["metadata"]["name"] == account
    binding = docs["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == docs["Role"]["metadata"]["name"]
    rule = docs["Role"]["rules"][0]
    assert "pods" in rule["resources"]
    assert {"list", "watch"} <= set(rule["verbs"])


def test_the_vllm_pods_run_with_what_routing_relies_on() -> None:
    container = _docs("vllm.yaml")["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    for flag in ("--enable-prefix-caching", "--prefix-caching-hash-algo=sha256_cbor",
                 "--enable-prompt-tokens-details"):
        assert flag in args
    config = json.loads(next(a for a in args if a.startswith("--kv-events-config="))
                        .split("=", 1)[1])
    assert config["enable_kv_cache_events"] is True
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config["endpoint"] == f"tcp://*:{ports['kv-events']}"
    assert config["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"
    assert {"name": "PYTHONHASHSEED", "value": "0"} in container["env"]
    assert container["readinessProbe"]["httpGet"]["port"] == "http"
