"""The package layout the architecture page promises: no import cycles between dofla's modules, counting
imports inside functions (outside ``dofla.commands``, the command-line layer that imports everything late),
and nothing under src/ importing experiments/ or bench/."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, name: str) -> set[str]:
    """Every module ``path`` (module ``name``) imports, wherever the import statement stands: at the top, in a
    function or under ``TYPE_CHECKING`` (absolute and relative imports; ``from a import b`` counts ``a`` and
    ``a.b``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the dofla modules it imports, for every module outside ``dofla.commands``."""
    modules = {module_name(path): path for path in SOURCE.rglob("*.py")}
    return {
        name: {target for target in imported_modules(path, name) if target in modules and target != name}
        for name, path in modules.items()
        if not name.startswith("dofla.commands")
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as the list of modules it passes (first repeated last), or None."""
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> list[str] | None:
        if name in stack:
            return stack[stack.index(name) :] + [name]
        if name in done or name not in graph:
            return None
        for target in sorted(graph[name]):
            cycle = visit(target, [*stack, name])
            if cycle:
                return cycle
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name, [])
        if cycle:
            return cycle
    return None


def test_the_checker_finds_a_cycle_closed_inside_a_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def late():\n    from pkg.high import thing\n")
    (package / "high.py").write_text("from . import low\nthing = 1\n")
    graph = {
        f"pkg.{stem}": {
            target
            for target in imported_modules(package / f"{stem}.py", f"pkg.{stem}")
            if target in ("pkg.low", "pkg.high")
        }
        for stem in ("low", "high")
    }
    assert graph == {"pkg.low": {"pkg.high"}, "pkg.high": {"pkg.low"}}
    assert find_cycle(graph) == ["pkg.high", "pkg.low", "pkg.high"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50  # the walk saw the package
    assert "dofla.loading" in graph["dofla.auto"]  # imported inside a function: an edge too
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The stages below a package that it must never import, even inside a function: the data flows one way
# (model in -> measure -> plan -> convert -> distil -> evaluate -> save).
ABOVE = {
    "dofla.models": ("dofla.dof", "dofla.planning", "dofla.convert", "dofla.distill", "dofla.evaluation"),
    "dofla.dof": ("dofla.planning", "dofla.convert", "dofla.distill", "dofla.evaluation", "dofla.pipeline"),
    "dofla.evaluation": ("dofla.planning", "dofla.distill", "dofla.pipeline"),
    "dofla.convert": ("dofla.planning", "dofla.distill", "dofla.evaluation", "dofla.loading"),
    "dofla.saving": ("dofla.convert", "dofla.loading", "dofla.auto"),
    "dofla.settings": ("dofla.dof", "dofla.planning", "dofla.convert", "dofla.cells", "dofla.pipeline"),
}


def test_the_lower_stages_never_import_the_higher_ones():
    graph = import_graph()
    for low, higher in ABOVE.items():
        for name, targets in graph.items():
            if name == low or name.startswith(low + "."):
                upward = sorted(t for t in targets for top in higher if t == top or t.startswith(top + "."))
                assert not upward, f"{name} imports {upward}, a later stage"


def test_the_library_never_imports_experiments_or_bench():
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(name.split(".")[0] in ("experiments", "bench") for name in names), path
