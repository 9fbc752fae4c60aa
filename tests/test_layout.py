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


def test_tests_readme_maps_every_test_file():
    text = (ROOT / "tests" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "tests").glob("test_*.py"))
               if f"`{p.name}`" not in text]
    assert not missing, f"tests/README.md misses {missing}: add each to its table"


def _module_imports() -> dict[str, set[str]]:
    """Each pipeflow module -> the pipeflow modules it imports at module level (imports
    inside functions are deferred on purpose and do not count)."""
    import ast

    names = {}
    for path in (ROOT / "pipeflow").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        edges = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names
                           else node.module for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in names and t != name}
        graph[name] = edges
    return graph


def test_module_imports_have_no_circle():
    graph = _module_imports()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


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
