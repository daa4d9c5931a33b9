"""The package's shape: no import circle, and no layer importing a later one.

Every ``import`` of a pipesim module anywhere in a file counts, those inside
functions included (a lazy import is still a dependency; a circle through
one only moves the failure to run time). Imports under ``if TYPE_CHECKING:``
never run, so they are exempt from the circle check but not from the layer
order. The layers are the ones the package docstrings state
(:mod:`pipesim.sim` lists the sub-packages of ``sim/`` in order).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = {
    "sim": "pipesim.sim",
    "kernels": "pipesim.kernels",
    "validate": "pipesim.validate",
    "experiments": "pipesim.experiments",
}

#: The order of the four top-level packages: each may import those before it.
TOP_ORDER = ["pipesim.sim", "pipesim.kernels", "pipesim.validate", "pipesim.experiments"]

#: The layers inside pipesim.sim, lowest first (pipesim.sim's docstring).
SIM_LAYERS = [
    ("pipesim.sim", "pipesim.sim.errors", "pipesim.sim.files", "pipesim.sim.limits", "pipesim.sim._gc"),
    ("pipesim.sim.ir",),
    ("pipesim.sim.strategies",),
    ("pipesim.sim.hardware",),
    ("pipesim.sim.workloads",),
    ("pipesim.sim.engine",),
    ("pipesim.sim.partition",),
    ("pipesim.sim.api", "pipesim.sim.interchange"),
    ("pipesim.sim.planning",),
]


def module_files() -> dict[str, Path]:
    """Every module of the package by its dotted name."""
    found = {}
    for folder, package in TOP.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path, modules: set[str]) -> list[tuple[str, bool]]:
    """The pipesim modules ``name`` imports, each with whether only for type checking."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = set()
    for node in ast.walk(tree):
        # only the body of ``if TYPE_CHECKING:`` never runs (not its else, not ``if not TYPE_CHECKING``)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            typing_only.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        for target in targets:
            if target.startswith("pipesim") and target != name:
                found.append((target, id(node) in typing_only))
    return found


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(imports that run, every import) per module."""
    files = module_files()
    runs, every = {}, {}
    for name, path in files.items():
        found = imports_of(name, path, set(files))
        runs[name] = {t for t, typing_only in found if not typing_only and t in files}
        every[name] = {t for t, _ in found}
    return runs, every


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in ``graph`` as the modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def layer_of(module: str) -> tuple[int, int]:
    """(top-level package, layer within pipesim.sim) of ``module``; the longest prefix wins."""
    top = max((i for i, p in enumerate(TOP_ORDER) if module == p or module.startswith(p + ".")), default=None)
    assert top is not None, f"{module} is in no known package"
    if top != 0:
        return top, 0
    best, rank = -1, None
    for i, layer in enumerate(SIM_LAYERS):
        for prefix in layer:
            # the package itself is layer 0; its modules and sub-packages each have their own row
            covers = module == prefix or (prefix != "pipesim.sim" and module.startswith(prefix + "."))
            if covers and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no layer of pipesim.sim: add it to SIM_LAYERS and the docstring"
    return 0, rank


def test_the_cycle_finder_finds_a_circle_and_passes_a_tree() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_import_reader_sees_every_kind_of_import(tmp_path) -> None:
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import pipesim.sim.errors\n"
        "from pipesim.sim import api\n"  # a submodule imported from its package
        "from pipesim.sim.ir.core import Action\n"
        "def f():\n"
        "    from pipesim.sim.engine import core\n"  # lazy, inside a function
        "if TYPE_CHECKING:\n"
        "    from pipesim.sim.hardware import machines\n"
        "else:\n"
        "    import pipesim.sim.planning\n"
    )
    modules = set(module_files())
    found = dict(imports_of("pipesim.sim.mod", source, modules))
    assert found == {
        "pipesim.sim.errors": False,
        "pipesim.sim.api": False,
        "pipesim.sim.ir.core": False,
        "pipesim.sim.engine.core": False,
        "pipesim.sim.hardware.machines": True,
        "pipesim.sim.planning": False,
    }


def test_the_graph_holds_known_edges() -> None:
    # the real tree is read, not an empty graph that would pass every check
    runs, _ = import_graph()
    assert "pipesim.sim.strategies.registry" in runs["pipesim.sim.strategies._common"]
    assert "pipesim.sim.partition.search" in runs["pipesim.sim.partition.split"]
    assert sum(len(v) for v in runs.values()) > 300


def test_a_new_sim_module_must_be_placed_in_a_layer() -> None:
    with pytest.raises(AssertionError, match="no layer"):
        layer_of("pipesim.sim.somewhere_new")


def test_no_import_circle() -> None:
    runs, _ = import_graph()
    cycle = find_cycle(runs)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_layer_imports_a_later_one() -> None:
    _, every = import_graph()
    wrong = []
    for module, targets in sorted(every.items()):
        for target in sorted(targets):
            if target == "pipesim":
                wrong.append(f"{module} imports the bare pipesim namespace")
            elif layer_of(target) > layer_of(module):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports of a later layer:\n" + "\n".join(wrong)


def test_layer_order_is_what_it_claims() -> None:
    # a lower layer importing a higher one is caught: the check is not vacuous
    assert layer_of("pipesim.sim.engine.core") > layer_of("pipesim.sim.ir.core")
    assert layer_of("pipesim.sim.planning.plan") > layer_of("pipesim.sim.api")
    assert layer_of("pipesim.experiments.cli") > layer_of("pipesim.validate.harness") > layer_of("pipesim.sim.api")


def test_imports_are_absolute() -> None:
    # a module's import names the layer it reaches into; a relative import hides it
    relative = []
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                relative.append(f"{name}:{node.lineno}")
    assert not relative, "relative imports: " + ", ".join(relative)


def test_sim_never_imports_torch() -> None:
    for name, path in module_files().items():
        if name.startswith("pipesim.sim"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
                assert not any(n.split(".")[0] in ("torch", "triton") for n in names), f"{name} imports torch"


def test_every_package_folder_is_installed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["setuptools"]["packages"])
    folders = {name for name, path in module_files().items() if path.name == "__init__.py"}
    assert folders == listed, (
        f"pyproject's packages differ from the tree: missing {folders - listed}, stale {listed - folders}"
    )


@pytest.mark.parametrize(
    "package",
    ["pipesim.sim.ir", "pipesim.sim.engine", "pipesim.sim.hardware", "pipesim.sim.partition", "pipesim.sim.strategies"],
)
def test_packages_keep_their_public_names(package) -> None:
    # the names users imported from the modules these packages replaced (what moved to
    # another package, StageCost among them, is listed in CHANGELOG.md)
    import importlib

    module = importlib.import_module(package)
    for name in getattr(module, "__all__", []):
        assert hasattr(module, name), f"{package}.{name}"
    assert {
        "pipesim.sim.ir": "Schedule",
        "pipesim.sim.engine": "simulate",
        "pipesim.sim.hardware": "load_hardware",
        "pipesim.sim.partition": "partition",
        "pipesim.sim.strategies": "build_schedule",
    }[package] in dir(module)
