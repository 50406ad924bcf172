"""The package's shape holds (the README's "Layout"): few modules at memsched/'s top level, no import cycle
between modules, ``tracer`` and ``policies`` never import ``memsched``, and no class is assembled from
mixins that work on their owner's state. Read from the source with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("memsched", "tracer", "policies")


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module ``name`` refers to (a module, or the package/module that defines the name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(mod: str, *, function_level: bool) -> set[str]:
    """The project's modules ``mod`` imports: at module level (``if TYPE_CHECKING:`` blocks included) and,
    with ``function_level``, inside functions too."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and (function_level or not in_function):
                names: list[str] = []
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                else:
                    base = child.module or ""
                    if child.level:
                        pkg = mod if is_pkg else mod.rpartition(".")[0]
                        for _ in range(child.level - 1):
                            pkg = pkg.rpartition(".")[0]
                        base = f"{pkg}.{base}" if base else pkg
                    names = [f"{base}.{a.name}" for a in child.names]
                for n in names:
                    target = _resolve(n)
                    if target is not None and target != mod:
                        found.add(target)
            visit(child, inner)

    visit(tree, False)
    return found


def _cycle(function_level: bool) -> list[str] | None:
    graph = {m: _imports(m, function_level=function_level) for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = dfs(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = dfs(m)
            if found:
                return found
    return None


def test_the_import_walk_sees_the_imports_it_checks():
    # The walk itself: a module-level import, a TYPE_CHECKING one and a function-local one are all seen.
    assert "memsched.chunks" in _imports("memsched.scheduler", function_level=False)
    assert "memsched.chunks.chunk" in _imports("memsched.chunks.events", function_level=False)
    assert "memsched.distributed" in _imports("memsched.scheduler", function_level=True)
    assert "memsched.distributed" not in _imports("memsched.scheduler", function_level=False)


def test_at_most_twelve_modules_at_the_top_of_memsched():
    top = sorted(p.name for p in (ROOT / "memsched").glob("*.py"))
    assert len(top) <= 12, top


@pytest.mark.parametrize("function_level", [False, True], ids=["module-level", "with-function-imports"])
def test_no_import_cycles(function_level):
    # Module level (TYPE_CHECKING blocks included) and even counting imports made inside functions.
    assert _cycle(function_level) is None, " -> ".join(_cycle(function_level) or [])


@pytest.mark.parametrize("pkg", ["tracer", "policies"])
def test_tracer_and_policies_never_import_memsched(pkg):
    bad = {m: sorted(n for n in _imports(m, function_level=True) if n.startswith("memsched"))
           for m in MODULES if m == pkg or m.startswith(pkg + ".")}
    assert not {m: n for m, n in bad.items() if n}


@pytest.mark.parametrize(("room", "later"), [("memsched.devices", "memsched.telemetry"),
                                             ("memsched.planning", "memsched.config")],
                         ids=["devices-not-telemetry", "planning-not-config"])
def test_a_room_imports_nothing_from_a_later_one(room, later):
    # The rooms follow the step's stages (docs/architecture.md): the devices name the copy tracks the step
    # timeline records (memsched.devices.transfers), and the planner reads its options from
    # memsched.planning.planner.PlanningOptions, which the attach options (memsched.config) build.
    bad = {m: sorted(n for n in _imports(m, function_level=True) if n == later or n.startswith(later + "."))
           for m in MODULES if m == room or m.startswith(room + ".")}
    assert not {m: n for m, n in bad.items() if n}


def test_no_class_is_assembled_from_project_mixins():
    # A project class takes at most one project base, and no project class is a mixin: each component owns
    # the state it reads (composition, as FSDP2 does).
    offenders = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            if node.name.endswith("Mixin"):
                offenders.append(f"{mod}.{node.name}")
            bases = [ast.unparse(b) for b in node.bases]
            project = [b for b in bases if b in _CLASS_NAMES]
            if len(project) > 1:
                offenders.append(f"{mod}.{node.name}({', '.join(bases)})")
    assert not offenders, offenders


_CLASS_NAMES = {n.name for p in MODULES.values() for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.ClassDef)}
