"""``--config FILE``: TOML with the same keys as the flags; flag > environment > file > default.

The committed examples are rendered by ``gateway.contracts.config_file.example``; to refresh them::

    python -c "from gateway.contracts.config_file import example; ..."  (see test_examples_load)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.contracts.config import SettingsError
from gateway.contracts.config_file import example
from gateway.settings import GatewaySettings, parse_settings
from worker.settings import WorkerSettings
from worker.settings import parse_settings as parse_worker_settings

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return str(path)


def test_file_values_apply_and_the_environment_and_flags_win(tmp_path: Path) -> None:
    path = write(tmp_path, 'port = 9100\nmax-attempts = 5\npolicy = "least_load"\n'
                           'worker = ["http://a:1", "http://b:2"]\nnormalize = false\n'
                           "load_factor = 2\naccess_log = \"text\"\n")
    s = parse_settings(["--config", path], environ={})
    assert (s.port, s.max_attempts, s.policy, s.normalize, s.access_log) == (
        9100, 5, "least_load", False, "text")
    assert s.worker == ("http://a:1", "http://b:2")
    assert s.load_factor == 2.0
    assert s.host == GatewaySettings().host  # not in the file: the default
    env = {"GATEWAY_PORT": "9200", "GATEWAY_MAX_ATTEMPTS": "2"}
    s = parse_settings(["--config", path], environ=env)
    assert (s.port, s.max_attempts, s.policy) == (9200, 2, "least_load")
    s = parse_settings(["--config", path, "--port", "9300", "--worker", "http://c:3"],
                       environ=env)
    assert (s.port, s.max_attempts, s.worker) == (9300, 2, ("http://c:3",))


def test_the_file_can_come_from_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "port = 9400\n")
    assert parse_settings([], environ={"GATEWAY_CONFIG": path}).port == 9400


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prot = 1\n", "unknown setting 'prot'; did you mean 'port'?"),
        ('port = "80"\n', "port: expected an integer"),
        ("normalize = 1\n", "normalize: expected true or false"),
        ("worker = [1]\n", "worker: expected a list of strings"),
        ("load_factor = true\n", "load_factor: expected a number"),
        ("policy = 3\n", "policy: expected a string"),
        ("port = \n", "is not valid TOML"),
    ],
)
def test_bad_files_are_refused_with_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        parse_settings(["--config", write(tmp_path, text)], environ={})


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read the config file"):
        parse_settings(["--config", str(tmp_path / "nope.toml")], environ={})


def test_the_worker_reads_the_same_kind_of_file(tmp_path: Path) -> None:
    path = tmp_path / "worker.toml"
    path.write_text('model = "tiny"\ncache-blocks = 64\nport = 8123\n')
    s = parse_worker_settings(["--config", str(path), "--port", "8124"], environ={})
    assert (s.model, s.cache_blocks, s.port) == ("tiny", 64, 8124)
    assert parse_worker_settings([], environ={"WORKER_CONFIG": str(path)}).model == "tiny"


def _uncommented(text: str) -> str:
    return "\n".join(line[2:] for line in text.splitlines()
                     if re.match(r"^# [a-z_]+ = ", line))


@pytest.mark.parametrize(
    ("name", "cls", "parse"),
    [("gateway", GatewaySettings, parse_settings),
     ("worker", WorkerSettings, parse_worker_settings)],
)
def test_examples_load_and_show_the_defaults(
    tmp_path: Path, name: str, cls: type, parse: object
) -> None:
    """Uncommenting every key of an example changes nothing: it documents the defaults."""
    text = (ROOT / "infra" / "config" / f"{name}.example.toml").read_text()
    assert text.startswith("# ")
    path = tmp_path / f"{name}.toml"
    path.write_text(_uncommented(text))
    assert callable(parse)
    assert parse(["--config", str(path)], environ={}) == cls()
    rendered = example(cls, "title", "X_")
    for key in re.findall(r"^# ([a-z_]+) = ", text, re.MULTILINE):
        assert f"# {key} = " in rendered


@pytest.mark.parametrize(
    ("name", "cls", "title", "env_prefix"),
    [("gateway", GatewaySettings, "Gateway settings: python -m gateway --config gateway.toml",
      "GATEWAY_"),
     ("worker", WorkerSettings,
      "Reference worker settings: python -m worker --config worker.toml", "WORKER_")],
)
def test_examples_list_every_setting(name: str, cls: type, title: str, env_prefix: str) -> None:
    """The examples are example()'s output: a setting added without them fails here (write
    them again with gateway.contracts.config_file.example)."""
    text = (ROOT / "infra" / "config" / f"{name}.example.toml").read_text()
    assert text == example(cls, title, env_prefix)
