"""The package layout the architecture page promises: no import cycles between dofla's modules at import
time, and nothing under src/ importing experiments/ or bench/."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> set[str]:
    """Modules imported when ``path`` is imported (imports inside functions run later and are left out)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in SOURCE.rglob("*.py")}
    return {
        name: {target for target in top_level_imports(path) if target in modules and target != name}
        for name, path in modules.items()
    }


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50  # the walk saw the package
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(name) :] + [name]))
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


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
