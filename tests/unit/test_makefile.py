"""The Makefile's choice of the interpreter the virtual environment is built from: the
distribution's optimized build when it can, python3 from PATH otherwise, and always the one
named by ``PYTHON``. Read from ``make -n`` (nothing is built)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def venv_interpreter(**variables: str) -> str:
    """The interpreter ``make`` would build ``.venv`` from, given these make variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "SYSTEM_PYTHON")}
    out = subprocess.run(
        ["make", "-n", "-B", ".venv/.installed", *(f"{k}={v}" for k, v in variables.items())],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    lines = [line for line in out.splitlines() if line.endswith("-m venv .venv")]
    assert len(lines) == 1, out
    return lines[0].removesuffix(" -m venv .venv")


def test_a_usable_system_interpreter_is_chosen() -> None:
    assert venv_interpreter(SYSTEM_PYTHON=sys.executable) == sys.executable


def test_an_older_or_missing_system_interpreter_falls_back_to_path(tmp_path: Path) -> None:
    old = tmp_path / "python3"
    old.write_text("#!/bin/sh\nexit 1\n")  # what a Python < 3.11 (or one without venv) says
    old.chmod(0o755)
    assert venv_interpreter(SYSTEM_PYTHON=str(old)) == "python3"
    assert venv_interpreter(SYSTEM_PYTHON=str(tmp_path / "missing")) == "python3"


def test_python_named_on_the_command_line_wins(tmp_path: Path) -> None:
    chosen = str(tmp_path / "python3.12")
    assert venv_interpreter(PYTHON=chosen, SYSTEM_PYTHON=sys.executable) == chosen
