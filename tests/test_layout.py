"""The layout tables cannot miss a file: docs/layout.md names every module of `pipeflow/`,
and tests/README.md names every test file."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _layout_section() -> str:
    return (ROOT / "docs" / "layout.md").read_text()


def test_readme_layout_names_every_module():
    section = _layout_section()
    missing = []
    for path in sorted((ROOT / "pipeflow").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name in ("__init__.py", "__main__.py") and rel != "pipeflow/__init__.py":
            continue
        package = rel.rsplit("/", 1)[0] + "/"
        if f"`{rel}`" in section or (package in ("pipeflow/planner/", "pipeflow/models/")
                                     and f"`{package}`" in section
                                     and (path.name in section or package == "pipeflow/planner/")):
            continue
        missing.append(rel)
    assert not missing, f"docs/layout.md misses {missing}: add a row for each"


def _guards_table() -> str:
    """The first cells of tests/README.md's table of what each file guards (only that table:
    the table of times names every file too, and would hide a file the guards miss)."""
    lines = (ROOT / "tests" / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| file | guards |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1])
    return "\n".join(rows)


def test_tests_readme_maps_every_test_file():
    table = _guards_table()
    missing = [p.name for p in sorted((ROOT / "tests").glob("test_*.py"))
               if f"`{p.name}`" not in table]
    assert not missing, f"tests/README.md's table of guards misses {missing}: add a row for each"


def test_tests_readme_times_every_test_file():
    # The table of times is tests/timings.py's (never by hand): every file in it, with a
    # figure, so a slow new file is seen when it lands. Rerun the script on your file's XML.
    text = (ROOT / "tests" / "README.md").read_text()
    start, end = "<!-- timings: start -->", "<!-- timings: end -->"
    assert start in text and end in text, "tests/README.md lost its table of times"
    timed = {line.split("`")[1] for line in text.split(start)[1].split(end)[0].splitlines()
             if line.startswith("| `test_") and any(c.strip() for c in line.split("|")[2:-1])}
    missing = [p.name for p in sorted((ROOT / "tests").glob("test_*.py")) if p.name not in timed]
    assert not missing, (f"tests/README.md's table of times misses {missing}: run "
                         f"`PIPEFLOW_TEST_TIMES=DIR bash tests/run_all.sh` (or only your "
                         f"file's job with --junitxml=DIR/serial.xml) and "
                         f"`python tests/timings.py DIR`")


def _module_names() -> dict[str, pathlib.Path]:
    """Each module of `pipeflow/` by its dotted name (a package by its folder's)."""
    names = {}
    for path in (ROOT / "pipeflow").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _module_imports(names: dict[str, pathlib.Path] | None = None) -> dict[str, set[str]]:
    """Each pipeflow module -> the pipeflow modules it imports anywhere: at module level, in
    a function body (a deferred import only postpones a circle to the first call, it does not
    remove it) and relative (`from . import x`)."""
    import ast

    names = _module_names() if names is None else names
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base
                           for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in names and t != name}
        graph[name] = edges
    return graph


def _import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` (a -> b -> ... -> a), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_module_imports_have_no_circle():
    circle = _import_circle(_module_imports())
    assert circle is None, ("import circle: " + " -> ".join(circle) + "; move what both "
                            "need into a module of its own, or pass it in")


def test_the_circle_check_sees_deferred_and_relative_imports(tmp_path):
    # The check itself: a circle closed by an import inside a function, and one through a
    # relative import, are both found (the hf / hf_checkpoint circle was the first kind).
    pkg = tmp_path / "pipeflow"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from pipeflow.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pipeflow.sub.a import x\n")
    (pkg / "c.py").write_text("from .sub import d\n")
    (pkg / "sub" / "d.py").write_text("def g():\n    from .. import c\n")
    names = {"pipeflow": pkg / "__init__.py", "pipeflow.sub": pkg / "sub" / "__init__.py",
             "pipeflow.sub.a": pkg / "sub" / "a.py", "pipeflow.sub.b": pkg / "sub" / "b.py",
             "pipeflow.c": pkg / "c.py", "pipeflow.sub.d": pkg / "sub" / "d.py"}
    graph = _module_imports(names)
    assert graph["pipeflow.sub.b"] == {"pipeflow.sub.a"}
    assert graph["pipeflow.sub.d"] == {"pipeflow.c"}
    assert _import_circle(graph) == ["pipeflow.c", "pipeflow.sub.d", "pipeflow.c"]
    graph["pipeflow.sub.d"] = set()
    assert _import_circle(graph) == ["pipeflow.sub.a", "pipeflow.sub.b", "pipeflow.sub.a"]


def _class_properties(path: str, cls: str) -> list[str]:
    """The properties a class defines (decorated, or `name = property(...)`), from its source."""
    import ast

    tree = ast.parse((ROOT / path).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    names = [f.name for f in body if isinstance(f, ast.FunctionDef)
             and any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)]
    return sorted(names + [t.id for a in body if isinstance(a, ast.Assign)
                           and getattr(getattr(a.value, "func", None), "id", "") == "property"
                           for t in a.targets])


def test_facts_are_read_where_they_live():
    # Engine keeps only the shortcuts docs/design.md documents; the rest is read from
    # `engine.stage` and `engine.plan`, and a stage's plan facts from `stage.plan`.
    assert _class_properties("pipeflow/engine.py", "Engine") == ["loss_scale", "schedule"]
    assert _class_properties("pipeflow/runtime/stage.py", "Stage") == []


def test_config_stops_at_the_facade():
    # Below the Engine no module takes `Config` whole: each part reads its own settings
    # record (ArrangeSettings, StageSettings, StepSettings), filled by the engine.
    import ast

    found = []
    for package in ("runtime", "comm", "schedules"):
        for path in sorted((ROOT / "pipeflow" / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "pipeflow.config" \
                        and any(a.name == "Config" for a in node.names):
                    found.append(path.relative_to(ROOT).as_posix())
    assert not found, f"{found} import Config: give the part a settings record instead"


def _imports_out_of(package: pathlib.Path, dotted: str) -> list[str]:
    """Each `file:line: what` under `package` (the package `dotted`, e.g. pipeflow.schedules)
    that imports pipeflow outside it: `import`/`from` at any depth (function bodies too), a
    relative import climbing out, and `importlib.import_module` / `__import__` of a literal
    (an f-string by its literal head)."""
    import ast

    top = dotted.split(".")[0]

    def outside(target: str) -> bool:
        return (target == top or target.startswith(top + ".")) and not (
            target == dotted or target.startswith(dotted + "."))

    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        here = list(path.relative_to(ROOT).with_suffix("").parts)
        if here[-1] == "__init__":
            here = here[:-1]
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    keep = len(here) - node.level + (path.name == "__init__.py")
                    base = ".".join(here[:max(keep, 0)] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if base in (top, "") else base for a in node.names]
            elif (isinstance(node, ast.Call) and node.args
                  and getattr(node.func, "attr", getattr(node.func, "id", "")) in
                  ("import_module", "__import__")):
                arg = node.args[0]
                if isinstance(arg, ast.JoinedStr) and arg.values:
                    arg = arg.values[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    # An f-string's head "pipeflow.x." names the package it reaches into.
                    targets = [arg.value.rstrip(".")]
            found += [f"{rel}:{node.lineno}: {t}" for t in targets if outside(t)]
    return found


def test_schedules_import_nothing_of_pipeflow_outside_themselves():
    # schedules/ is the bottom layer: pure schedule data that config, runtime, the planner
    # and the CLI read; an import out of it would climb back up (docs/layout.md).
    found = _imports_out_of(ROOT / "pipeflow" / "schedules", "pipeflow.schedules")
    assert not found, ("pipeflow/schedules/ imports pipeflow outside itself: "
                       + "; ".join(found) + ". Move what it needs into schedules/, or have "
                       "the caller pass it in")


def test_the_schedules_import_check_sees_each_kind_of_import(tmp_path, monkeypatch):
    package = tmp_path / "pipeflow" / "schedules"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from pipeflow.schedules.ir import Action\n"
                                         "from . import ir\n")
    (package / "ir.py").write_text("import re\nfrom pipeflow.schedules import spec\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _imports_out_of(package, "pipeflow.schedules") == []
    planted = {"a.py": "from pipeflow.config import ConfigError\n",
               "b.py": "def f():\n    import pipeflow.runtime.balance\n",
               "c.py": "from pipeflow import tree\n",
               "d.py": "from .. import config\n",
               "e.py": "from ..runtime.recompute import _fmt\n",
               "f.py": "import importlib\nimportlib.import_module(f'pipeflow.runtime.{x}')\n"}
    for name, text in planted.items():
        (package / name).write_text(text)
    found = _imports_out_of(package, "pipeflow.schedules")
    assert [f.split(":")[0].rsplit("/", 1)[1] for f in found] == sorted(planted), found
    assert "pipeflow/schedules/e.py:1: pipeflow.runtime.recompute" in found


# mpi4py's blocking collectives, which spin inside MPI while they wait.
_SPINNING = {"allgather", "allreduce", "bcast", "gather", "scatter", "alltoall", "barrier",
             "Allgather", "Allreduce", "Bcast", "Gather", "Barrier", "Reduce", "reduce"}


def _spinning_collectives(source: str, name: str) -> list[str]:
    """`name:LINE: comm.OP` for each call of a blocking mpi4py collective on a communicator
    in `source`: a method call on a plain name other than `waiting` and `dist`."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _SPINNING and isinstance(node.func.value, ast.Name) \
                and node.func.value.id not in ("waiting", "dist", "torch_dist"):
            found.append(f"{name}:{node.lineno}: {node.func.value.id}.{node.func.attr}")
    return found


def test_multi_rank_tests_wait_for_each_other_by_yielding():
    # At 4 ranks on 2 cores the ranks that spin in a test's own collective take the cores
    # the rank they wait for needs (tests/README.md: the -n 4 part 6 min 15 s spinning,
    # 3 min 46 s yielding).
    # test_waiting_mpi.py compares the yielding collectives with MPI's own.
    found = [hit for path in sorted((ROOT / "tests").glob("test_*_mpi.py"))
             if path.name != "test_waiting_mpi.py"
             for hit in _spinning_collectives(path.read_text(), path.name)]
    assert not found, ("multi-rank tests call mpi4py's blocking collectives, which spin: "
                       + "; ".join(found) + ". Use toy.allgather / gather / bcast / barrier")


def test_the_spinning_collective_check_sees_each_form():
    planted = ("WORLD.allgather(x)\ncomm.bcast(x, root=0)\ngroup.Barrier()\n"
               "comm.allreduce(x, op=MPI.MAX)\n")
    allowed = ("allgather(comm, x)\nwaiting.bcast(comm, x, 0)\ndist.barrier()\n"
               "engine.stats.gather\n")
    assert [h.split(": ")[1] for h in _spinning_collectives(planted, "t.py")] == \
        ["WORLD.allgather", "comm.bcast", "group.Barrier", "comm.allreduce"]
    assert _spinning_collectives(allowed, "t.py") == []
