"""docker-compose.yml against the compose specification, with no Docker engine and no network.

The schema is the compose-spec JSON schema that ``check-jsonschema`` ships (vendored there with
its licence, ``vendor.compose-spec``), run through its CLI as a user would.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
STORE = "redis://redis:6379/0"


def check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(path)], capture_output=True, text=True, timeout=60,
    )


def load() -> dict[str, Any]:
    data: dict[str, Any] = YAML(typ="safe").load(COMPOSE.read_text())
    return data


def test_compose_file_follows_the_compose_specification() -> None:
    result = check(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_check_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yml"
    broken.write_text("services:\n  gateway:\n    image: 5\n    healthcheck:\n"
                      "      interval: [1]\n    ports: {a: b}\n")
    result = check(broken)
    assert result.returncode == 1
    assert "healthcheck" in result.stdout + result.stderr


def test_workers_scale_by_registration() -> None:
    services = load()["services"]
    default = {name for name, service in services.items() if not service.get("profiles")}
    assert default == {"redis", "gateway", "worker"}
    # Prometheus and Grafana only on demand: docker compose --profile observability up
    assert set(services) - default == {"prometheus", "grafana"}
    assert all(services[n]["profiles"] == ["observability"] for n in ("prometheus", "grafana"))
    for name, service in services.items():
        assert "healthcheck" in service, name
    worker = services["worker"]
    # `docker compose up --scale worker=N` needs no fixed name and no host port.
    assert "container_name" not in worker
    assert "ports" not in worker
    command = " ".join(worker["command"])
    assert f"--store {STORE}" in command
    assert "--public-url" in command
    assert STORE in services["gateway"]["command"]
    assert "--worker" not in " ".join(services["gateway"]["command"])
    for service in ("worker", "gateway"):
        assert services[service]["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("line", [
    line for line in COMPOSE.read_text().splitlines() if "$" in line and not line.startswith("#")
])
def test_container_side_variables_are_escaped_from_compose_interpolation(line: str) -> None:
    assert not re.search(r"(?<!\$)\$(?!\$)", line.replace("$$", "")), line
