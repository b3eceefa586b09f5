"""The package's imports follow the module map of docs/development.md: every module in one layer,
no import pointing to a higher layer, no imports closing a circle, and no subpackage importing a
subpackage placed above it (each sits at its highest row of the map).

The layers are read from the map itself (its table's first column, top layer first), so the map
is the one place that says where a module belongs. Every import of every module is read with
``ast``, those inside functions included: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "distribuuuu"
MAP = REPO / "docs" / "development.md"
MAP_HEADING = "## Dive into the code: the module map"
HOW_TO_PLACE = (
    "A module goes in the lowest row of the table under '" + MAP_HEADING + "' in docs/development.md "
    "that is above every module it imports and at or below every module that imports it; an import "
    "that must point up means the code it calls belongs higher (or the call belongs in the caller)."
)


def package_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its __init__.py)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def map_layers() -> dict[str, int]:
    """Dotted module name -> its row in the module map (0: the top layer), read from the table's first column."""
    lines = MAP.read_text().split(MAP_HEADING, 1)[1].splitlines()
    rows = [line for line in lines if line.startswith("|")][2:]  # past the header and its rule
    layers: dict[str, int] = {}
    for row, line in enumerate(rows):
        for name in re.findall(r"`([\w/]+\.py)`", line.split("|")[1]):
            parts = ("distribuuuu", *Path(name).with_suffix("").parts)
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            assert module not in layers, f"{name} is listed twice in the module map of docs/development.md"
            layers[module] = row
    return layers


def imports(modules: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(importer, line, imported) for every import of a package module by a package module."""
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(module, path, node, modules):
                if target != module:
                    found.append((module, node.lineno, target))
    return found


def _targets(module: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    """The package modules one import statement loads: ``from a import b`` is a.b where that is a module."""
    if isinstance(node, ast.Import):
        return [_longest_module(alias.name, modules) for alias in node.names if _longest_module(alias.name, modules)]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the importer's package
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    found = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    return sorted({name for name in found if name in modules})


def _longest_module(name: str, modules: dict[str, Path]) -> str:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _where(module: str, modules: dict[str, Path], line: int | None = None) -> str:
    path = modules[module].relative_to(REPO)
    return f"{path}:{line}" if line else str(path)


def test_every_module_of_the_package_has_one_place_in_the_module_map():
    modules, layers = package_modules(), map_layers()
    unplaced = [_where(m, modules) for m in modules if m not in layers]
    assert not unplaced, f"in no layer of the module map: {', '.join(unplaced)}. {HOW_TO_PLACE}"
    gone = sorted(m for m in layers if m not in modules)
    assert not gone, f"the module map of docs/development.md lists modules that do not exist: {gone}"


def test_no_import_points_to_a_higher_layer():
    modules, layers = package_modules(), map_layers()
    upward = [
        f"{_where(importer, modules, line)} (row {layers[importer] + 1} of the map) imports {target} "
        f"(row {layers[target] + 1}): a module imports its own row or the rows below it"
        for importer, line, target in imports(modules)
        if importer in layers and target in layers and layers[target] < layers[importer]
    ]
    assert not upward, "imports that point up the module map:\n" + "\n".join(upward) + "\n" + HOW_TO_PLACE


def upward_subpackage_imports(modules: dict[str, Path], layers: dict[str, int], root: Path) -> list[str]:
    """'file:line imports module' for each import of a subpackage placed above the importer's own."""
    package = {m: path.relative_to(root).parts[0] if path.parent != root else "" for m, path in modules.items()}
    place: dict[str, int] = {}  # a subpackage sits at the highest row that holds one of its modules
    for module, row in layers.items():
        if package.get(module):
            place[package[module]] = min(place.get(package[module], row), row)
    return [
        f"{modules[importer].relative_to(root.parent)}:{line} imports {target}: "
        f"{package[target]}/ sits above {package[importer]}/ in the module map"
        for importer, line, target in imports(modules)
        if package[importer]
        and package[target]
        and package[importer] != package[target]
        and (place[package[target]], package[target]) < (place[package[importer]], package[importer])
    ]


def test_no_subpackage_imports_a_subpackage_above_it():
    upward = upward_subpackage_imports(package_modules(), map_layers(), PACKAGE)
    assert not upward, "imports of a subpackage placed higher in the map:\n" + "\n".join(upward) + "\n" + HOW_TO_PLACE


def test_the_subpackage_check_names_an_import_of_a_subpackage_above(tmp_path):
    """On a made-up package: low/ imports high/, which the map places above it (same row: by name)."""
    files = {"high/a.py": "from pkg.low import b\n", "low/b.py": "import os\n", "low/c.py": "from pkg.high import a\n"}
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    modules = {"pkg." + name[:-3].replace("/", "."): tmp_path / "pkg" / name for name in files}
    for layers in (
        {"pkg.high.a": 0, "pkg.low.b": 1, "pkg.low.c": 1},
        {"pkg.high.a": 0, "pkg.low.b": 0, "pkg.low.c": 0},
    ):
        assert upward_subpackage_imports(modules, layers, tmp_path / "pkg") == [
            "pkg/low/c.py:1 imports pkg.high.a: high/ sits above low/ in the module map"
        ]


# The layers below the run's set-up take explicit arguments: none of them reads the config.
CONFIG_FREE = ("data", "records", "checkpointing", "runtime", "models")


def config_imports(modules: dict[str, Path]) -> list[str]:
    """'file:line imports X' for each import of distribuuuu.config or yacs by a config-free subpackage."""
    found = []
    for module, path in modules.items():
        if module.split(".")[1:2] not in ([p] for p in CONFIG_FREE):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad = [n for n in names if n == "yacs" or n.startswith(("yacs.", "distribuuuu.config"))]
            found += [f"{path}:{node.lineno} imports {n}" for n in bad]
    return found


def test_the_layers_below_the_runs_set_up_know_nothing_of_the_config():
    found = config_imports(package_modules())
    assert not found, (
        "modules of " + ", ".join(f"{p}/" for p in CONFIG_FREE) + " take explicit arguments; the config is read in "
        "training/ (inputs.py, preprocessing.py, parallelize.py, run.py):\n" + "\n".join(found)
    )


def test_the_config_check_sees_an_import_of_the_config_below_the_set_up(tmp_path):
    (tmp_path / "distribuuuu" / "data").mkdir(parents=True)
    path = tmp_path / "distribuuuu" / "data" / "bad.py"
    path.write_text("from yacs.config import CfgNode\n\ndef f():\n    from distribuuuu.config import load_cfg\n")
    assert config_imports({"distribuuuu.data.bad": path}) == [
        f"{path}:1 imports yacs.config",
        f"{path}:4 imports distribuuuu.config",
    ]


def test_no_imports_close_a_circle():
    modules = package_modules()
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for importer, line, target in imports(modules):
        edges[importer].setdefault(target, line)
    circles = [c for c in strongly_connected(edges) if len(c) > 1]
    described = [_describe(circle, edges, modules) for circle in circles]
    assert not described, "imports that close a circle:\n" + "\n".join(described) + "\n" + HOW_TO_PLACE


def _describe(circle: list[str], edges: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    """Each import inside the circle, as 'file:line imports module'."""
    inside = set(circle)
    steps = [
        f"{_where(m, modules, line)} imports {target}"
        for m in sorted(circle)
        for target, line in sorted(edges[m].items())
        if target in inside
    ]
    return "  circle " + " <-> ".join(sorted(circle)) + ": " + "; ".join(steps)


def strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components: each component of more than one module is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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
            components.append(component)

    for v in edges:
        if v not in index:
            visit(v)
    return components


def test_the_checks_see_an_upward_import_a_circle_and_a_lazy_import(tmp_path):
    """The import reader on a made-up package: a lazy import counts, a circle is found."""
    files = {
        "low": "import os\n",
        "high": "from pkg import low\n\ndef f():\n    from pkg import mid  # lazy\n",
        "mid": "from pkg.high import f\n",
    }
    modules = {f"pkg.{name}": tmp_path / f"{name}.py" for name in files}
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    found = {(importer, target) for importer, _, target in imports(modules)}
    assert found == {("pkg.high", "pkg.low"), ("pkg.high", "pkg.mid"), ("pkg.mid", "pkg.high")}
    edges = {m: {t: 1 for i, t in found if i == m} for m in modules}
    assert sorted(sorted(c) for c in strongly_connected(edges) if len(c) > 1) == [["pkg.high", "pkg.mid"]]
