"""The package's layers (docs/DESIGN.md, "Layers"): imports run one way, bottom up, with no
cycle, no module imports another's private names, and the package never imports
``pipelines``. Read from the source with ``ast``, so a lazy import inside a function
counts as much as one at the top (only ``if TYPE_CHECKING:`` blocks are exempt).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "poimen_data"

#: Layer of each top-level name under poimen_data; a module may import its own layer and
#: those below it. ``errors`` is the floor every layer may use.
RANK = {
    "errors": 0,
    "model": 1,
    "storage": 2,
    "log": 3,
    "fold": 4,
    "jobs": 5,
    "workload": 6,
    # the face: what users import and run (the bench measures all of it, the viewer included)
    "__init__": 8, "cli": 8, "testing": 8, "events": 8, "synth": 8, "verifiers": 8, "view": 8,
    "bench": 8,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported, name imported from it or None, line) for every runtime import."""
    tree = ast.parse(path.read_text(), str(path))
    if path.is_relative_to(PKG):
        me = module_name(path)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    else:
        package = ""
    out: list[tuple[str, str | None, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, None, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for a in child.names:
                    out.append((base, a.name, child.lineno))
            visit(child)

    visit(tree)
    return out


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def internal_edges() -> list[tuple[str, str, str | None, int]]:
    """(importer, imported module, name, line) for imports of poimen_data modules; ``from
    poimen_data.x import y`` where y is a submodule counts as importing ``poimen_data.x.y``."""
    mods = package_modules()
    edges = []
    for me, path in mods.items():
        for target, name, line in imports(path):
            if not (target == "poimen_data" or target.startswith("poimen_data.")):
                continue
            if name is not None and f"{target}.{name}" in mods:
                target, name = f"{target}.{name}", None
            edges.append((me, target, name, line))
    return edges


def test_every_module_is_in_a_known_layer() -> None:
    unknown = sorted({layer(m) for m in package_modules()} - set(RANK))
    assert unknown == [], f"add these to RANK (and to the README's map): {unknown}"


def test_imports_never_go_up_a_layer() -> None:
    upward = []
    for me, target, _, line in internal_edges():
        if target == "poimen_data":  # the face's re-exports: only the face may use them
            if RANK[layer(me)] < RANK["__init__"]:
                upward.append(f"{me}:{line} imports the package root")
            continue
        if RANK[layer(target)] > RANK[layer(me)]:
            upward.append(f"{me}:{line} ({layer(me)}) imports {target} ({layer(target)})")
    assert upward == []


def test_no_module_imports_another_modules_private_names() -> None:
    private = [f"{me}:{line} imports {name} from {target}"
               for me, target, name, line in internal_edges()
               if name is not None and name.startswith("_") and not name.startswith("__")
               and target != me]
    assert private == []


def test_no_import_cycle() -> None:
    mods = package_modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for me, target, _, _ in internal_edges():
        # importing a package runs its __init__; an edge to it is an edge to that module
        if target in mods and target != me and target != "poimen_data":
            graph[me].add(target)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            # a package's __init__ importing its own submodules is how re-exports work
            if node.rsplit(".", 1)[0] == nxt or nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                dfs(nxt, stack)
        stack.pop()
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m, [])
    assert cycles == []


def test_the_checks_catch_what_they_claim_to(tmp_path: Path) -> None:
    """The walker sees lazy imports and private names, and skips TYPE_CHECKING."""
    f = tmp_path / "mod.py"
    f.write_text("from typing import TYPE_CHECKING\n"
                 "if TYPE_CHECKING:\n    from poimen_data.jobs import grade\n"
                 "def f():\n    from poimen_data.fold._fold import _secret\n")
    assert [(t, n) for t, n, _ in imports(f)] == [("typing", "TYPE_CHECKING"),
                                                  ("poimen_data.fold._fold", "_secret")]


@pytest.mark.parametrize("module", ["poimen_data", "poimen_data.cli"])
def test_importing_the_package_imports_no_pipeline(module: str) -> None:
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pipelines'))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=PKG.parent)
    assert p.stdout.strip() == "[]"


def test_docstrings_cite_sections_that_exist() -> None:
    """Code cites the design by section name; a renamed section must not leave them stale."""
    design = (PKG.parent / "docs" / "DESIGN.md").read_text()
    sections = {line[3:].strip() for line in design.splitlines() if line.startswith("## ")}
    cited = set()
    for path in [*PKG.rglob("*.py"), *(PKG.parent / "tests").glob("*.py")]:
        for name in re_citation.findall(path.read_text()):
            cited.add((path.name, name))
    assert cited, "no citation found: the pattern is wrong"
    assert sorted(c for c in cited if c[1] not in sections) == []


re_citation = __import__("re").compile(r'docs/DESIGN\.md``?, "([^"]+)"')
