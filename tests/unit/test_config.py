"""Tests for gateway.contracts.config.load_settings, driven by gateway.settings.GatewaySettings."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from gateway.contracts.config import SettingsError, load_settings
from gateway.settings import GatewaySettings, parse_settings


def _load(argv: Sequence[str] = (), env: Mapping[str, str] | None = None) -> GatewaySettings:
    return load_settings(
        GatewaySettings,
        list(argv),
        env_prefix="GATEWAY_",
        prog="test-gateway",
        description="test",
        environ=env or {},
    )


def test_defaults() -> None:
    settings = _load()
    assert settings == GatewaySettings()
    assert settings.host == "127.0.0.1"
    assert settings.port == 8000
    assert settings.worker == ()
    assert settings.policy == "cache_aware"
    assert settings.load_factor == 1.25
    assert settings.normalize is True
    assert settings.index_ttl_s == 600.0


def test_defaults_ignore_unrelated_environment() -> None:
    assert _load(env={"PORT": "1", "WORKER_PORT": "2", "GATEWAY": "x"}) == GatewaySettings()


@pytest.mark.parametrize(
    ("env", "field", "expected"),
    [
        pytest.param({"GATEWAY_PORT": "9001"}, "port", 9001, id="int"),
        pytest.param({"GATEWAY_HOST": "0.0.0.0"}, "host", "0.0.0.0", id="str"),
        pytest.param({"GATEWAY_LOAD_FACTOR": "1.5"}, "load_factor", 1.5, id="float"),
        pytest.param({"GATEWAY_POLICY": "round_robin"}, "policy", "round_robin", id="policy"),
        pytest.param({"GATEWAY_WORKER": "http://a:1,http://b:2"}, "worker",
                     ("http://a:1", "http://b:2"), id="worker-comma-list"),
        pytest.param({"GATEWAY_WORKER": " http://a:1 , ,http://b:2, "}, "worker",
                     ("http://a:1", "http://b:2"), id="worker-list-spaces-and-empties"),
        pytest.param({"GATEWAY_WORKER": "http://a:1"}, "worker", ("http://a:1",),
                     id="worker-single"),
        pytest.param({"GATEWAY_WORKER": ""}, "worker", (), id="worker-empty"),
        pytest.param({"GATEWAY_NORMALIZE": "false"}, "normalize", False, id="bool-false"),
        pytest.param({"GATEWAY_NORMALIZE": "0"}, "normalize", False, id="bool-0"),
        pytest.param({"GATEWAY_NORMALIZE": "Off"}, "normalize", False, id="bool-off"),
        pytest.param({"GATEWAY_NORMALIZE": " TRUE "}, "normalize", True, id="bool-true"),
        pytest.param({"GATEWAY_NORMALIZE": "yes"}, "normalize", True, id="bool-yes"),
        pytest.param({"GATEWAY_NORMALIZE": "1"}, "normalize", True, id="bool-1"),
    ],
)
def test_env(env: dict[str, str], field: str, expected: Any) -> None:
    settings = _load(env=env)
    assert getattr(settings, field) == expected
    others = {f.name for f in dataclasses.fields(GatewaySettings)} - {field}
    defaults = GatewaySettings()
    assert all(getattr(settings, name) == getattr(defaults, name) for name in others)


@pytest.mark.parametrize(
    ("argv", "field", "expected"),
    [
        pytest.param(["--port", "9100"], "port", 9100, id="int"),
        pytest.param(["--port=9100"], "port", 9100, id="int-equals"),
        pytest.param(["--load-factor", "2"], "load_factor", 2.0, id="float-dashes"),
        pytest.param(["--no-normalize"], "normalize", False, id="no-bool"),
        pytest.param(["--normalize"], "normalize", True, id="bool"),
        pytest.param(["--worker", "http://a:1"], "worker", ("http://a:1",), id="one-worker"),
        pytest.param(["--worker", "http://a:1", "--worker", "http://b:2"], "worker",
                     ("http://a:1", "http://b:2"), id="repeated-worker"),
        pytest.param(["--policy", "least_load"], "policy", "least_load", id="policy"),
    ],
)
def test_flags(argv: list[str], field: str, expected: Any) -> None:
    assert getattr(_load(argv), field) == expected


@pytest.mark.parametrize(
    ("argv", "env", "field", "expected"),
    [
        pytest.param(["--port", "9200"], {"GATEWAY_PORT": "9001"}, "port", 9200, id="port"),
        pytest.param(["--normalize"], {"GATEWAY_NORMALIZE": "false"}, "normalize", True,
                     id="bool-on-beats-env-off"),
        pytest.param(["--no-normalize"], {"GATEWAY_NORMALIZE": "true"}, "normalize", False,
                     id="bool-off-beats-env-on"),
        pytest.param(["--worker", "http://c:3"], {"GATEWAY_WORKER": "http://a:1,http://b:2"},
                     "worker", ("http://c:3",), id="worker-flags-replace-env-list"),
        pytest.param(["--policy", "bounded_hash"], {"GATEWAY_POLICY": "round_robin"},
                     "policy", "bounded_hash", id="policy"),
        pytest.param([], {"GATEWAY_WORKER": "http://a:1,http://b:2"}, "worker",
                     ("http://a:1", "http://b:2"), id="env-used-without-flag"),
    ],
)
def test_flag_beats_env(
    argv: list[str], env: dict[str, str], field: str, expected: Any
) -> None:
    assert getattr(_load(argv, env), field) == expected


@pytest.mark.parametrize(
    ("env", "name"),
    [
        pytest.param({"GATEWAY_PORT": "eighty"}, "GATEWAY_PORT", id="int"),
        pytest.param({"GATEWAY_PORT": "80.5"}, "GATEWAY_PORT", id="int-float"),
        pytest.param({"GATEWAY_LOAD_FACTOR": "lots"}, "GATEWAY_LOAD_FACTOR", id="float"),
        pytest.param({"GATEWAY_NORMALIZE": "maybe"}, "GATEWAY_NORMALIZE", id="bool"),
        pytest.param({"GATEWAY_NORMALIZE": "2"}, "GATEWAY_NORMALIZE", id="bool-2"),
    ],
)
def test_bad_env_value_raises_settings_error(env: dict[str, str], name: str) -> None:
    with pytest.raises(SettingsError, match=name):
        _load(env=env)


def test_bad_env_value_raises_even_when_flag_given() -> None:
    # The environment is parsed before the flags; a broken variable is reported, not masked.
    with pytest.raises(SettingsError, match="GATEWAY_PORT"):
        _load(["--port", "1"], {"GATEWAY_PORT": "x"})


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        pytest.param(["--policy", "fastest"], {}, id="flag"),
        pytest.param([], {"GATEWAY_POLICY": "fastest"}, id="env"),
    ],
)
def test_bad_policy_raises_value_error(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        _load(argv, env)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--max-attempts", "0"], id="max-attempts"),
        pytest.param(["--chars-per-token", "0"], id="chars-per-token"),
        pytest.param(["--block-chars", "0"], id="block-chars"),
        pytest.param(["--anchor-blocks", "0"], id="anchor-blocks"),
        pytest.param(["--max-held-body-bytes", "1000", "--max-body-bytes", "2000"],
                     id="a body budget smaller than one body"),
        pytest.param(["--max-held-body-bytes", "-1"], id="max-held-body-bytes"),
    ],
)
def test_invalid_values_rejected_by_post_init(argv: list[str]) -> None:
    with pytest.raises(ValueError, match="must be"):
        _load(argv)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--port", "eighty"], id="bad-int-flag"),
        pytest.param(["--no-such-flag"], id="unknown-flag"),
        pytest.param(["--port"], id="missing-value"),
    ],
)
def test_bad_flags_exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _load(argv)
    assert info.value.code == 2
    assert "test-gateway" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("field", "value"),
    [
        pytest.param("port", 1, id="port"),
        pytest.param("worker", ("http://x:1",), id="worker"),
        pytest.param("normalize", False, id="normalize"),
    ],
)
def test_result_is_frozen(field: str, value: Any) -> None:
    settings = _load(["--worker", "http://a:1"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(settings, field, value)


def test_worker_is_a_tuple_not_a_list() -> None:
    assert isinstance(_load(["--worker", "http://a:1"]).worker, tuple)
    assert isinstance(_load(env={"GATEWAY_WORKER": "http://a:1"}).worker, tuple)


def test_parse_settings_wrapper() -> None:
    settings = parse_settings(["--port", "7000"], {"GATEWAY_NORMALIZE": "off"})
    assert settings.port == 7000
    assert settings.normalize is False
    assert settings.normalize_options().enabled is False
    assert settings.policy_options().load_factor == settings.load_factor
    opts = settings.fingerprint_options()
    assert (opts.block_chars, opts.max_blocks, opts.anchor_blocks) == (64, 16_384, 4)


def test_help_mentions_env_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _load(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "GATEWAY_PORT" in out
    assert "--no-normalize" in out


def test_not_a_dataclass_rejected() -> None:
    class Plain:
        pass

    with pytest.raises(TypeError, match="not a dataclass"):
        load_settings(Plain, [], env_prefix="X_", prog="p", description="d", environ={})
