"""The layering of the source tree, read from its imports (AST, nothing imported).

* ``gateway/routing`` is pure: no aiohttp, no redis, no backends, store or HTTP handlers (the
  simulator runs the same code).
* ``gateway/backends`` carry requests; they import no routing policy (the value types in
  ``gateway.routing.types`` they may).
* ``gateway/contracts`` (what gateway and worker share) imports nothing else from the gateway.
* ``worker/`` imports from the gateway only ``gateway.contracts``, apart from the imports listed
  in ``WORKER_NOT_YET_IN_CONTRACTS`` (each one a module still to move into the contracts; the
  list may only shrink: an entry the worker no longer imports fails the test).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (importing file, imported module) pairs that break the worker rule today.
WORKER_NOT_YET_IN_CONTRACTS = frozenset({
    ("worker/__main__.py", "gateway.config"),
    ("worker/__main__.py", "gateway.httpserver"),
    ("worker/settings.py", "gateway.config"),
    ("worker/settings.py", "gateway.telemetry.tracing"),
    ("worker/observe.py", "gateway.telemetry.tracing"),
    ("worker/server.py", "gateway.telemetry.tracing"),
    ("worker/kv_events.py", "gateway.kvevents.wire"),
    ("worker/server.py", "gateway.kvevents.keys"),
    ("worker/register.py", "gateway.store.base"),
    ("worker/register.py", "gateway.store.redis"),
})


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool = False) -> Iterator[str]:
    """Every module ``source`` imports (nested and ``TYPE_CHECKING`` imports included; relative
    imports resolved against ``module``)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if not is_package:
                    package = package[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            yield base
            # ``from gateway import store`` imports the module gateway.store
            yield from (f"{base}.{alias.name}" for alias in node.names)


def in_tree(name: str) -> str:
    """``name`` cut down to the module of this tree it names (``gateway.store.base.WorkerRecord``
    -> ``gateway.store.base``); names outside the tree are kept whole."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:end])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts[:end])
    return name


def file_imports(path: Path) -> set[str]:
    source = path.read_text(encoding="utf-8")
    return {in_tree(n) for n in imports(source, module_name(path), path.name == "__init__.py")}


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources(folder)
        for name in file_imports(path)
        if within(name, forbidden)
    )


def test_the_import_reader_sees_every_form() -> None:
    source = (
        "import aiohttp.web\nfrom redis import asyncio\nfrom ..store import base\n"
        "def f():\n    from gateway.api import x\n"
        "if TYPE_CHECKING:\n    from . import engine\n"
    )
    found = set(imports(source, "gateway.routing.policies.demo"))
    assert {"aiohttp.web", "redis", "gateway.routing.store.base", "gateway.api",
            "gateway.routing.policies.engine"} <= found
    assert within("gateway.api", ("gateway.api",))
    assert not within("gateway.apiary", ("gateway.api",))


def test_routing_is_pure() -> None:
    forbidden = ("aiohttp", "redis", "gateway.backends", "gateway.store", "gateway.api",
                 "gateway.app", "gateway.proxy")
    assert violations("gateway/routing", forbidden) == []


def test_backends_import_no_policy() -> None:
    """Backends may name the routing value types (a Worker), never what decides."""
    policy = ("gateway.routing.engine", "gateway.routing.policies", "gateway.routing.ring",
              "gateway.routing.prefix_index", "gateway.session")
    assert violations("gateway/backends", policy) == []


def test_contracts_import_nothing_else_from_the_gateway() -> None:
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources("gateway/contracts")
        for name in file_imports(path)
        if within(name, ("gateway",)) and not within(name, ("gateway.contracts",))
    ]
    assert found == []


def _worker_gateway_imports() -> set[tuple[str, str]]:
    return {
        (str(path.relative_to(ROOT)), name)
        for path in sources("worker")
        for name in file_imports(path)
        if within(name, ("gateway",)) and not within(name, ("gateway.contracts",))
        and name != "gateway"
    }


def test_the_worker_imports_only_the_contracts_from_the_gateway() -> None:
    found = _worker_gateway_imports()
    assert found - WORKER_NOT_YET_IN_CONTRACTS == set()


def test_the_list_of_exceptions_only_shrinks() -> None:
    stale = WORKER_NOT_YET_IN_CONTRACTS - _worker_gateway_imports()
    assert stale == set(), "no longer imported: remove from WORKER_NOT_YET_IN_CONTRACTS"


@pytest.mark.parametrize("folder", ["gateway/routing", "gateway/backends", "gateway/contracts",
                                    "worker"])
def test_every_folder_is_read(folder: str) -> None:
    assert sources(folder)
