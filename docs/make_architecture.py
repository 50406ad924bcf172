"""Regenerate the generated blocks of docs/architecture.md from the code's own structure.

Three blocks, each between ``<!-- BEGIN GENERATED: NAME ... -->`` and ``<!-- END GENERATED: NAME -->``:

* ``stages``: the table of a training step's stages and the modules ("rooms") that own them, from
  :data:`STAGES` below; every module named must exist and define the symbol named with it.
* ``diagram``: one Mermaid flowchart of the step's data flow (the stages in their rooms) and of the chunk
  lifecycle, read from ``memsched/chunks/binding.py``: the :class:`Binding` enum, its ``TRANSITIONS`` table
  and the ``ChunkBindings`` methods that bind a chunk into each state.
* ``notes``: the index of the ``[Note: ...]`` blocks in ``memsched/``, ``tracer/`` and ``policies/``.

Usage::

    python docs/make_architecture.py            # rewrite the blocks in docs/architecture.md
    python docs/make_architecture.py --check    # exit 1 (and show the difference) when they are stale

``tests/test_docs.py`` runs the check, so a change of the code these blocks describe fails the tests until
this script is run again.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import pathlib
import re
import sys
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
NOTE_DIRS = ("memsched", "tracer", "policies")
BINDING_FILE = "memsched/chunks/binding.py"


class Stage(NamedTuple):
    """One stage of a training step: its name, when it runs, the modules that own it (``path:symbol``; the
    first names the room) and what a reader who knows FSDP2 would compare it with."""

    key: str
    name: str
    when: str
    modules: tuple[str, ...]
    fsdp2: str
    binds: tuple[tuple[str, str], ...] = ()  # (Binding member, what binds it)


#: The stages in the order a run meets them. The first module of each is its owner; its folder is the room.
STAGES: tuple[Stage, ...] = (
    Stage("attach", "attach", "`memsched.attach(model, ...)`: options checked once, components built",
          ("memsched/scheduler.py:attach", "memsched/config.py:make_config"),
          "`fully_shard(model)`"),
    Stage("chunk", "chunk",
          "at attach (registration order); re-packed in first-use order at the end of warmup",
          ("memsched/chunks/store.py:ChunkStore", "memsched/chunks/layout.py:search_chunk_size",
           "memsched/chunks/sizing.py:chunk_bytes", "memsched/chunks/binding.py:ChunkBindings"),
          "`FSDPParamGroup` (one flat buffer per group) and `FSDPParam` (a parameter's views)",
          (("DEVICE", "built"),)),
    Stage("trace", "trace",
          "the warmup steps (`warmup_steps`, default 1): every op, module and parameter read",
          ("memsched/runtime/warmup.py:WarmupTrace", "tracer/memory_tracer.py:MemoryTracer",
           "tracer/accounting.py:StorageAccountant", "tracer/param_reads.py:ParamReads",
           "tracer/timeline.py:MemoryTimeline"),
          "none: FSDP2 measures nothing before it runs"),
    Stage("plan", "plan",
          "inside the last warmup `step()`: problem from the trace, policy, fetch schedule, moves",
          ("memsched/planning/planner.py:Planner", "memsched/planning/problem.py:build_problem",
           "memsched/planning/first_use.py:first_use_order", "memsched/planning/reads.py:chunk_accesses",
           "policies/builtin.py:auto_policy", "policies/schedule.py:schedule_params",
           "memsched/planning/cost_model.py:WarmupCosts"),
          "none: the user picks `CPUOffloadPolicy` (all or nothing) and `reshard_after_forward`"),
    Stage("replan", "re-plan", "before each forward after warmup (`replan=\"auto\"`): the inputs' shapes",
          ("memsched/planning/elastic.py:Elastic", "memsched/runtime/elastic_hooks.py:install_elastic_hooks"),
          "none"),
    Stage("fetch", "fetch/evict", "forward and backward: each module's reads, on the plan's schedule",
          ("memsched/runtime/param_fetch.py:ParamFetcher",
           "memsched/runtime/fetch_schedule.py:ScheduleCursor",
           "memsched/runtime/residency.py:Residency", "memsched/runtime/saved_params.py:SavedParams",
           "memsched/runtime/fetch_hooks.py:FetchHooks", "memsched/runtime/waits.py:H2DWaits",
           "memsched/runtime/read_guard.py:ReadGuard", "memsched/devices/transfers.py:Streams",
           "memsched/distributed/sharded_params.py:ParamShards"),
          "`FSDPParamGroup` pre-forward all-gather (unshard), post-forward reshard, "
          "`set_modules_to_forward_prefetch`",
          (("DEVICE", "fetch, or the next forward"), ("ABSENT", "evict while computing"),
           ("SHARDED", "ZeRO-3 reshard"))),
    Stage("gradoff", "gradient offload", "backward, as each chunk's gradients complete",
          ("memsched/chunks/backward.py:BackwardTracker", "memsched/chunks/gradients.py:GradBuffers",
           "memsched/chunks/grad_offload.py:GradOffload",
           "memsched/distributed/grad_reduction.py:GradientReducer", "memsched/chunks/events.py:ChunkEvents"),
          "post-backward reduce-scatter; with `CPUOffloadPolicy` the sharded gradients go to the host",
          (("HOST", "backward's end, one rank"),)),
    Stage("update", "update",
          "`optimizer.step()`: checks, clipping, device chunks on the device, host chunks on the CPU",
          ("memsched/optim/hybrid_adamw.py:HybridAdamW", "memsched/optim/grads.py:GradChecks",
           "memsched/optim/clipping.py:Clipper", "memsched/optim/adam.py:fused_adamw_",
           "memsched/optim/host_updates.py:HostUpdates", "memsched/optim/early_update.py:EarlyUpdates",
           "memsched/optim/streamed_update.py:StreamedUpdates",
           "memsched/distributed/engine.py:ZeroEngine"),
          "the user's optimizer on the sharded parameters (on the CPU with `CPUOffloadPolicy`)"),
    Stage("report", "report", "every steady-state step is timed; reports and exports on demand",
          ("memsched/telemetry/step_timeline.py:StepTimeline", "memsched/telemetry/host_usage.py:HostUsage",
           "memsched/report/text.py:render_report", "memsched/report/exports/__init__.py:"),
          "none"),
)

#: The data flow between stages (the order above, plus the steady-state loop).
EDGES: tuple[tuple[str, str, str], ...] = (
    ("attach", "chunk", ""), ("chunk", "trace", ""), ("trace", "plan", "end of warmup"),
    ("plan", "fetch", "steady state"), ("fetch", "gradoff", "backward"), ("gradoff", "update", "step()"),
    ("update", "report", ""), ("update", "replan", "next step"), ("replan", "fetch", "forward"),
)


# -- reading the code ---------------------------------------------------------------------------------------
def _room(path: str) -> str:
    """The room of a module: its folder (``memsched/`` for the package's top-level modules)."""
    parts = pathlib.PurePosixPath(path).parts
    return "/".join(parts[:2]) + "/" if parts[0] == "memsched" and len(parts) > 2 else parts[0] + "/"


def _defines(path: str, symbol: str) -> bool:
    """Whether ``path`` defines ``symbol`` at its top level (class, function, or assigned name)."""
    tree = ast.parse((ROOT / path).read_text())
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == symbol:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == symbol for t in targets):
                return True
    return False


def check_stages() -> None:
    """Every module a stage names exists and defines the symbol named with it."""
    missing = []
    for stage in STAGES:
        for ref in stage.modules:
            path, _, symbol = ref.partition(":")
            if not (ROOT / path).is_file():
                missing.append(f"{stage.name}: {path} does not exist")
            elif symbol and not _defines(path, symbol):
                missing.append(f"{stage.name}: {path} does not define {symbol}")
    if missing:
        raise SystemExit("docs/make_architecture.py: STAGES is stale:\n  " + "\n  ".join(missing))


def lifecycle() -> tuple[list[str], dict[str, list[str]], dict[str, list[str]]]:
    """The chunk lifecycle as the code states it: the :class:`Binding` members in order, ``TRANSITIONS``
    (member -> members it may change into) and, per member, the ``ChunkBindings`` methods that bind into
    it."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    binding = importlib.import_module("memsched.chunks.binding")
    members = [m.name for m in binding.Binding]
    transitions = {m.name: [n.name for n in binding.Binding if n in binding.TRANSITIONS[m]]
                   for m in binding.Binding}
    entered: dict[str, list[str]] = {m: [] for m in members}
    tree = ast.parse((ROOT / BINDING_FILE).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ChunkBindings")
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
            continue
        for call in ast.walk(fn):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "_set"):
                for node in ast.walk(call):
                    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                            and node.value.id == "Binding" and node.attr in entered
                            and fn.name not in entered[node.attr]):
                        entered[node.attr].append(fn.name)
    for stage in STAGES:
        for member, _ in stage.binds:
            if member not in members:
                raise SystemExit(f"docs/make_architecture.py: stage {stage.name!r} binds {member}, which "
                                 f"{BINDING_FILE} no longer has ({members})")
    return members, transitions, entered


_NOTE_DEF = re.compile(r"^\s*(?:\"\"\"|#+|//+|\*)?\s*\[Note: ([^\]]+)\](.*)$")


def notes() -> list[tuple[str, str, str]]:
    """``(title, path, symbol)`` of every ``[Note: ...]`` block defined in the code, in room and file order. A
    definition opens its line (after a docstring's quotes or a comment mark) and is followed by the end of
    the line or by its first sentence; a reference is followed by ``in``, ``(``, ``)`` or punctuation."""
    found = []
    for top in NOTE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".py", ".cpp") or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            lines = path.read_text().splitlines()
            scopes = _scopes(path) if path.suffix == ".py" else []
            for i, line in enumerate(lines, start=1):
                m = _NOTE_DEF.match(line)
                if m is None:
                    continue
                rest = m.group(2)
                if rest.strip() and (not rest.startswith(" ") or re.match(r" (in |\()", rest)
                                     or not re.match(r" [A-Za-z`]", rest)):
                    continue
                found.append((m.group(1).strip(), rel, _innermost(scopes, i)))
    return found


def _scopes(path: pathlib.Path) -> list[tuple[int, int, str]]:
    """``(first line, last line, qualified name)`` of every class and function of a Python file."""
    out: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((child.lineno, child.end_lineno or child.lineno, name))
                visit(child, name + ".")

    visit(ast.parse(path.read_text()), "")
    return out


def _innermost(scopes: list[tuple[int, int, str]], line: int) -> str:
    inside = [s for s in scopes if s[0] <= line <= s[1]]
    return max(inside, key=lambda s: s[0])[2] if inside else ""


# -- the blocks ---------------------------------------------------------------------------------------------
def _link(path: str, text: str | None = None) -> str:
    """A link from docs/ to a file of the repository."""
    return f"[{text or path}](../{path})"


def stages_block() -> str:
    rows = ["| # | stage | when | room | modules (owner first) | FSDP2 counterpart |",
            "| --- | --- | --- | --- | --- | --- |"]
    for i, stage in enumerate(STAGES, start=1):
        mods = []
        for ref in stage.modules:
            path, _, symbol = ref.partition(":")
            mods.append(_link(path) + (f" `{symbol}`" if symbol else ""))
        room = _room(stage.modules[0].partition(":")[0])
        rows.append(f"| {i} | **{stage.name}** | {stage.when} | `{room}` | {'<br>'.join(mods)} | "
                    f"{stage.fsdp2} |")
    return "\n".join(rows)


def _label(*lines: str) -> str:
    return '"' + "<br/>".join(s.replace('"', "#quot;") for s in lines) + '"'


def diagram_block() -> str:
    members, transitions, entered = lifecycle()
    out = ["```mermaid", "flowchart TB"]
    rooms: dict[str, list[Stage]] = {}
    for stage in STAGES:
        rooms.setdefault(_room(stage.modules[0].partition(":")[0]), []).append(stage)
    for r, (room, stages) in enumerate(rooms.items()):
        out.append(f"  subgraph room{r}[{_label(room)}]")
        for stage in stages:
            owner, _, symbol = stage.modules[0].partition(":")
            where = f"{pathlib.PurePosixPath(owner).name}: {symbol}"
            out.append(f"    {stage.key}[{_label(stage.name, where)}]")
        out.append("  end")
    for a, b, text in EDGES:
        out.append(f"  {a} -->|{_label(text)}| {b}" if text else f"  {a} --> {b}")
    out.append(f"  subgraph lifecycle[{_label('chunk lifecycle: Binding and TRANSITIONS, ' + BINDING_FILE)}]")
    for m in members:
        how = ", ".join(f"{name}()" for name in entered[m]) or "built"
        out.append(f"    b_{m}[{_label(m, how)}]")
    out.append("  end")
    for m in members:
        for n in transitions[m]:
            out.append(f"  b_{m} -->|re-bind| b_{n}" if n == m else f"  b_{m} --> b_{n}")
    for stage in STAGES:
        for member, text in stage.binds:
            out.append(f"  {stage.key} -.->|{_label(text)}| b_{member}")
    out.append("```")
    return "\n".join(out)


def notes_block() -> str:
    rows = ["| room | note | file | in |", "| --- | --- | --- | --- |"]
    for title, path, symbol in notes():
        rows.append(f"| `{_room(path)}` | [Note: {title.replace('|', '&#124;')}] | {_link(path)} | "
                    f"{f'`{symbol}`' if symbol else 'module'} |")
    return "\n".join(rows)


BLOCKS = {"stages": stages_block, "diagram": diagram_block, "notes": notes_block}


def generate() -> dict[str, str]:
    """Every generated block's content, as the code reads now."""
    check_stages()
    return {name: make() for name, make in BLOCKS.items()}


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(^<!-- BEGIN GENERATED: {name}\b[^\n]*-->\n)(.*?)(^<!-- END GENERATED: {name} -->)",
                      re.DOTALL | re.MULTILINE)


def committed(text: str) -> dict[str, str]:
    """The generated blocks as ``text`` (docs/architecture.md) holds them."""
    found = {}
    for name in BLOCKS:
        m = _pattern(name).search(text)
        if m is None:
            raise SystemExit(f"{DOC}: no block {name!r} (<!-- BEGIN GENERATED: {name} --> ... "
                             f"<!-- END GENERATED: {name} -->)")
        found[name] = m.group(2).removesuffix("\n")
    return found


def render(text: str, blocks: dict[str, str]) -> str:
    for name, content in blocks.items():
        text = _pattern(name).sub(lambda m, c=content: m.group(1) + c + "\n" + m.group(3), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/architecture.md is stale")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    new = render(text, generate())
    if args.check:
        if new != text:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                       "docs/architecture.md", "generated now"))
            print("docs/architecture.md is stale: run `python docs/make_architecture.py`")
            return 1
        return 0
    if new != text:
        DOC.write_text(new)
        print("docs/architecture.md: generated blocks rewritten")
    else:
        print("docs/architecture.md: up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
