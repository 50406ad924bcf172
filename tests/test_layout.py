"""The package's shape holds (the README's "Layout"): few modules at memsched/'s top level, no import cycle
between modules, ``tracer`` and ``policies`` never import ``memsched``, and no class is assembled from
mixins that work on their owner's state. Read from the source with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
import pathlib
import re

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


def _chunk_fields() -> set[str]:
    """The fields of :class:`memsched.chunks.chunk.Chunk`: every ``self.X`` its methods assign."""
    tree = ast.parse(MODULES["memsched.chunks.chunk"].read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Chunk")
    return {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            for t in ast.walk(t) if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


# Names the project gives a chunk (``c``, ``chunk``, ``new_chunk``, ...), and Chunk fields whose names other
# objects' fields share (``p.data``, ``p.grad``, ``self.steps``): an assignment to one of those counts when
# its target is a name like these, or a subscript of ``chunks`` (``store.chunks[i].data = ...``).
_CHUNK_NAME = re.compile(r"^(c|ch|chunk|\w+_chunk|chunk_\w+)$")
_SHARED_NAMES = {"data", "grad", "steps", "index", "group", "numel", "params", "ranges", "dtype", "device",
                 "lo", "hi", "ready", "frozen", "master", "spare", "placement", "lean"}


def _chunk_writes(path: pathlib.Path, fields: set[str]) -> list[str]:
    """``file:line`` of each assignment to a Chunk field in ``path`` (outside a ``self.X`` of its own
    class)."""
    found = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            for t in ast.walk(target):
                if not (isinstance(t, ast.Attribute) and t.attr in fields and isinstance(t.ctx, ast.Store)):
                    continue
                owner = t.value
                named = isinstance(owner, ast.Name) and bool(_CHUNK_NAME.match(owner.id))
                listed = isinstance(owner, ast.Subscript) and "chunks" in ast.unparse(owner.value)
                own_field = isinstance(owner, ast.Name) and owner.id == "self"
                if named or listed or (t.attr not in _SHARED_NAMES and not own_field
                                       and not isinstance(owner, ast.Name)):
                    found.append(f"{where}:{t.lineno}: {ast.unparse(target)}")
    return found


def test_chunk_fields_are_written_by_chunk_methods_only():
    # Chunk owns its transitions (its docstring): other modules call its named methods (set_data,
    # keep_grad_shard, drop_param_shard, ...), never assign its fields.
    fields = _chunk_fields()
    assert {"data", "grad", "grad_shard", "param_shard", "placement", "spare", "h2d_event"} <= fields
    offenders = [w for mod, path in MODULES.items() if mod != "memsched.chunks.chunk"
                 for w in _chunk_writes(path, fields)]
    assert not offenders, offenders


def test_the_chunk_write_check_sees_writes(tmp_path):
    # The check itself: writes through a chunk's name, through the chunk list and of a field only a chunk
    # has are seen; a parameter's .data and a class's own field are not.
    src = tmp_path / "m.py"
    src.write_text("c.data = None\nchunk.grad_shard = s\nstore.chunks[0].spare = None\nx.y.h2d_event = e\n"
                   "p.data = v\nself.placement = 'host'\nself.steps += 1\nc.lo, c.hi = 0, 4\n")
    writes = [w.rpartition(": ")[2] for w in _chunk_writes(src, _chunk_fields())]
    assert writes == ["c.data", "chunk.grad_shard", "store.chunks[0].spare", "x.y.h2d_event",
                      "(c.lo, c.hi)", "(c.lo, c.hi)"]


def test_the_chunk_store_stays_small():
    # The store keeps the chunks, their layout and re-packing, their placement and views; the stages of a
    # step it composes have rooms of their own (memsched.chunks.backward, memsched.chunks.gradients,
    # memsched.chunks.binding): a change to one stage touches its room (issue 41).
    lines = len((ROOT / "memsched" / "chunks" / "store.py").read_text().splitlines())
    assert lines < 800, lines


def test_the_parameter_fetcher_stays_small():
    # The fetcher decides at each read what its rooms do; each room owns its state (issue 41): the forward
    # hooks (memsched.runtime.fetch_hooks), the schedule followed (memsched.runtime.fetch_schedule), the
    # chunks on the device and their moves (memsched.runtime.residency), the saved-tensor hooks
    # (memsched.runtime.saved_params) and the recorded reads (memsched.runtime.read_recording).
    lines = len((ROOT / "memsched" / "runtime" / "param_fetch.py").read_text().splitlines())
    assert lines < 500, lines
