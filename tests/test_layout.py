"""The package layout the architecture page promises: no import cycles between dofla's modules, counting
imports inside functions (outside ``dofla.commands``, the command-line layer that imports everything late),
and nothing under src/ importing experiments/ or bench/."""

from __future__ import annotations

import ast
import re
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


# ---------------------------------------------------------------- the architecture page names every module

ROOT = SOURCE.parent
NAME = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:/\w+)*(?:\.py\b|/(?!\w)))")


def layout_names(block: str) -> set[Path]:
    """The paths (from the repository root) that a package-layout block names. Indentation is the tree: a
    line that starts with a folder (``ops/``) opens it for the rest of the line and for the lines indented
    deeper below it; every other name on a line is a file or folder of the innermost open folder."""
    names, open_folders = set(), []  # (indent, path)
    for line in block.splitlines():
        text = line.lstrip()
        if not text:
            continue
        indent = len(line) - len(text)
        while open_folders and open_folders[-1][0] >= indent:
            open_folders.pop()
        folder = open_folders[-1][1] if open_folders else ROOT
        for position, match in enumerate(NAME.finditer(text)):
            path = folder / match.group(1)
            names.add(path)
            if position == 0 and match.start() == 0 and match.group(1).endswith("/"):
                open_folders.append((indent, path))
                folder = path
    return names


def architecture_layout_block() -> str:
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## Package layout", 1)[1]
    return section.split("```", 2)[1]


def test_the_layout_reader_follows_the_tree():
    block = "src/dofla/\n  a.py, b.py   x\n  ops/   one: c.py\n    linear/   d.py\n  e.py\nbench/  f.py\n"
    source = ROOT / "src" / "dofla"
    assert layout_names(block) == {
        source,
        source / "a.py",
        source / "b.py",
        source / "ops",
        source / "ops" / "c.py",
        source / "ops" / "linear",
        source / "ops" / "linear" / "d.py",
        source / "e.py",
        ROOT / "bench",
        ROOT / "bench" / "f.py",
    }


def test_the_architecture_page_names_every_module_and_only_ones_that_exist():
    named = layout_names(architecture_layout_block())
    package = SOURCE / "dofla"
    modules = {path for path in package.rglob("*.py") if path.name != "__init__.py" or path.parent == package}
    folders = {path.parent for path in package.rglob("__init__.py")}
    missing = sorted(str(path.relative_to(SOURCE)) for path in (modules | folders) - named)
    assert not missing, f"docs/architecture.md's package layout does not name: {', '.join(missing)}"
    gone = sorted(str(path.relative_to(ROOT)) for path in named if not path.exists())
    assert not gone, f"docs/architecture.md's package layout names what does not exist: {', '.join(gone)}"
