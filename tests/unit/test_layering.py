"""The layering of the source tree, read from its imports (AST, nothing imported).

* ``gateway/routing`` is pure: no aiohttp, no redis, no backends, store or HTTP handlers (the
  simulator runs the same code).
* ``gateway/backends`` carry requests; they import no routing policy (the value types in
  ``gateway.routing.types`` they may).
* ``gateway/contracts`` (what gateway and worker share) imports nothing else from the gateway,
  and of third-party packages only those in ``CONTRACT_PACKAGES``: what both sides need to
  speak the same protocols. redis is among them deliberately: the worker registers itself with
  the registry client, and the registry's key schema is defined once, next to the worker
  record it stores; the client is the only I/O the contracts do (besides the aiohttp server
  plumbing and tracing export both servers run).
* ``worker/`` imports from the gateway only ``gateway.contracts``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Third-party packages the contracts may use, and what for.
CONTRACT_PACKAGES = frozenset({
    "aiohttp",        # the JSON-error HTTP runner
    "jinja2",         # chat templates
    "multidict",      # aiohttp's header mappings, for the lean HTTP path's requests
    "msgspec",        # the KV-event wire format
    "opentelemetry",  # tracing setup
    "orjson",         # the canonical JSON of tools and tool calls in the reference template
    "redis",          # the worker registry client
    "xxhash",         # KV block keys
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


def test_contracts_use_only_the_shared_packages() -> None:
    found = sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources("gateway/contracts")
        for name in file_imports(path)
        if name.split(".")[0] not in sys.stdlib_module_names
        and name.split(".")[0] not in CONTRACT_PACKAGES | {"gateway"}
    )
    assert found == []


def test_the_worker_imports_only_the_contracts_from_the_gateway() -> None:
    found = sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources("worker")
        for name in file_imports(path)
        if within(name, ("gateway",)) and not within(name, ("gateway.contracts",))
        and name != "gateway"
    )
    assert found == []


@pytest.mark.parametrize("folder", ["gateway/routing", "gateway/backends", "gateway/contracts",
                                    "worker"])
def test_every_folder_is_read(folder: str) -> None:
    assert sources(folder)
