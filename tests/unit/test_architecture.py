"""The import rules of docs/architecture.md, checked by walking every import in the source.

- ``workers`` imports nothing of ``controlplane`` but ``controlplane.wire`` and ``controlplane.kafka``;
- ``wire`` imports no other part of the project; ``kafka`` only ``wire``; the fold (``rollout``)
  only ``wire``: no I/O; then ``coordinator``, ``api`` and ``cli`` each only what is below it;
  in ``workers``: ``weights`` < ``runners`` < ``agent``, and ``demo`` beside the agent;
- only ``controlplane.kafka`` imports aiokafka;
- no import circle between modules;
- torch, torch_xla, safetensors and vllm are imported only by runner, weights and demo modules,
  so the control plane imports anywhere;
- the agent's parts get what they need when they are built: no ``assert self._x ...`` on their
  own state in ``workers.agent``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("controlplane", "workers")
HEAVY = ("torch", "torch_xla", "safetensors", "vllm")
#: package -> the project packages it may import (besides its own modules)
WIRE, KAFKA, FOLD = "controlplane.wire", "controlplane.kafka", "controlplane.rollout"
ALLOWED: dict[str, tuple[str, ...]] = {
    WIRE: (),
    KAFKA: (WIRE,),
    FOLD: (WIRE,),
    "controlplane.coordinator": (WIRE, KAFKA, FOLD),
    "controlplane.api": (WIRE, KAFKA, FOLD, "controlplane.coordinator"),
    "controlplane.cli": (WIRE, KAFKA, FOLD, "controlplane.coordinator", "controlplane.api"),
    "workers": (WIRE, KAFKA, "workers"),
    "workers.weights": (WIRE,),
    "workers.runners": (WIRE, "workers.weights"),
    "workers.agent": (WIRE, KAFKA, "workers.runners", "workers.weights"),
    "workers.demo": (WIRE, "workers.runners", "workers.weights"),
}
HEAVY_ALLOWED = ("workers.runners", "workers.weights", "workers.demo")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top_level
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            yield module, node.lineno, id(node) in top_level
            for alias in node.names:  # `from pkg import module`
                if f"{module}.{alias.name}" in MODULES:
                    yield f"{module}.{alias.name}", node.lineno, id(node) in top_level


def _project(module: str) -> str | None:
    """The project module ``module`` names (itself or the package it is inside), if any."""
    while module:
        if module in MODULES:
            return module
        module = module.rpartition(".")[0]
    return None


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_tree_is_what_the_rules_are_about() -> None:
    for package in ALLOWED:
        assert package in MODULES, f"{package} is gone: update the rules"
    assert len(MODULES) > 40


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_layer_imports_only_what_it_may(package: str) -> None:
    may = (package, *ALLOWED[package])
    broken = [
        f"{name} ({MODULES[name].relative_to(ROOT)}:{line}) imports {target}"
        for name in MODULES
        if _within(name, package)
        for imported, line, _ in _imports(name, MODULES[name])
        if (target := _project(imported)) is not None
        and not any(_within(target, allowed) for allowed in may)
    ]
    assert not broken, "\n".join(broken)


def test_no_import_circle() -> None:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for imported, _, _ in _imports(name, path):
            target = _project(imported)
            if target is not None and target != name and not _within(name, target):
                graph[name].add(target)
    cycles = _cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_heavy_libraries_are_imported_only_by_runners_weights_and_demo() -> None:
    broken = [
        f"{name} ({MODULES[name].relative_to(ROOT)}:{line}) imports {imported}"
        for name, path in MODULES.items()
        if not any(_within(name, p) for p in HEAVY_ALLOWED)
        for imported, line, _ in _imports(name, path)
        if imported.split(".")[0] in HEAVY
    ]
    assert not broken, "\n".join(broken)


def test_only_the_kafka_package_speaks_kafka() -> None:
    broken = [
        f"{name} ({MODULES[name].relative_to(ROOT)}:{line}) imports {imported}"
        for name, path in MODULES.items()
        if not _within(name, KAFKA)
        for imported, line, _ in _imports(name, path)
        if imported.split(".")[0] == "aiokafka"
    ]
    assert not broken, "\n".join(broken)


def _asserts_on_self(path: Path) -> Iterator[int]:
    """Lines of ``assert`` statements that read an attribute of ``self``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assert) and any(
            isinstance(sub, ast.Attribute)
            and isinstance(sub.value, ast.Name)
            and sub.value.id == "self"
            for sub in ast.walk(node.test)
        ):
            yield node.lineno


def test_the_agent_asserts_nothing_about_its_own_state() -> None:
    broken = [
        f"{MODULES[name].relative_to(ROOT)}:{line}"
        for name in MODULES
        if _within(name, "workers.agent")
        for line in _asserts_on_self(MODULES[name])
    ]
    assert not broken, "assert on self in the agent:\n" + "\n".join(broken)


def test_the_assert_rule_catches_one(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("class A:\n    def f(self):\n        assert self._x is not None\n")
    assert list(_asserts_on_self(path)) == [3]


def test_the_rules_catch_a_forbidden_import(tmp_path: Path) -> None:
    """The walk sees imports inside functions and `from pkg import module` forms."""
    path = tmp_path / "probe.py"
    path.write_text(
        "def f():\n    from controlplane.coordinator import follower\n    import torch\n"
    )
    seen = {imported for imported, _, _ in _imports("workers.probe", path)}
    assert {"controlplane.coordinator.follower", "torch"} <= seen
    assert _project("controlplane.coordinator.follower") == "controlplane.coordinator.follower"
