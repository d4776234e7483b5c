"""The package's shape: the core imports no model family and no command line, nothing imports in a
circle, and each of the spine's rules has one owner.  Read from the source (no imports run)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ds_pipe_ext"
CORE = ("costs", "partition", "simulate", "instrument", "pipe", "plan")
# defined once in the package: a second def or class of one of these names is a second answer
# the spine's rules, each defined once: the layout, the ZeRO rule, the schedule parser, the step model
# and its one prediction (``predict``) and one lower bound
ONE_OWNER = {"Layout": "layout.py", "zero_model_states": "costs/zero.py", "parse_schedule": "simulate/schedules.py",
             "StepModel": "simulate/step_model.py", "predict": "simulate/step_model.py",
             "step_lower_bound": "simulate/step_model.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every ds_pipe_ext module ``name`` imports, at the top or inside a function."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def test_the_core_imports_no_model_family_and_no_command_line():
    modules = _modules()
    offending = []
    for name, path in modules.items():
        if name.split(".")[1:2] and name.split(".")[1] in CORE:
            assert path.name != "command.py", f"{path}: command-line modules live in ds_pipe_ext/cli/"
            bad = [t for t in _imports(name, path, modules)
                   if t.startswith(("ds_pipe_ext.models", "ds_pipe_ext.cli"))]
            offending += [f"{name} -> {t}" for t in bad]
    assert not offending, offending


def test_the_import_graph_has_no_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_no_two_packages_import_each_other():
    """Package level (a top-level module counts as its own): ``layout`` reads ``simulate``'s schedules, never
    the reverse; ``parallel`` reads ``models``, never the reverse; and so on for every pair."""
    modules = _modules()

    def package(name: str) -> str:
        return name.split(".")[1] if "." in name else name

    edges: dict[tuple[str, str], str] = {}
    for name, path in modules.items():
        for target in _imports(name, path, modules):
            a, b = package(name), package(target)
            if a != b:
                edges.setdefault((a, b), f"{name} -> {target}")
    both = sorted(f"{edges[a, b]} and {edges[b, a]}" for a, b in edges if (b, a) in edges and a < b)
    assert not both, both


def test_each_rule_of_the_spine_has_one_owner():
    where: dict[str, list[str]] = {name: [] for name in ONE_OWNER}
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in where:
                where[node.name].append(str(path.relative_to(ROOT)))
    assert where == {name: [owner] for name, owner in ONE_OWNER.items()}
