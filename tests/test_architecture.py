"""The import graph of src/lmserve: no circles, and no import from a lower floor to a higher one.

The floors are docs/architecture.md's table ("Floors"), held here as data: a module may import its own floor
and the floors below it, never one above. Every import counts: module level, inside a function, under
TYPE_CHECKING (a lazy import still ties the two modules together; it only hides the circle until run time).
Edges come from the source text (`ast`), so this runs in milliseconds and imports nothing of lmserve.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ARCHITECTURE_MD = SRC.parent / "docs" / "architecture.md"

# lowest first; a module takes the floor of its longest matching entry (a package name covers its submodules)
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    # torch-free nouns and readers: a request and its parameters, what is read from a checkpoint, the ledger, and
    # the LoRA request (its file is in lora/, the rest of which runs on the model floor)
    ("leaves", ("sampling_params", "request", "default_model", "checkpoint", "memory", "lora.request", "grpc_proto")),
    ("config", ("config",)),
    ("core", ("core",)),
    ("model", ("kernels", "model", "distributed", "sample", "worker", "spec_decode", "lora")),
    ("engine", ("engine", "observability", "parsers")),
    ("entrypoints", ("lmserve", "llm", "entrypoints", "bench", "sim", "web")),
]

# Known exceptions (module names without the "lmserve." prefix): a circle as its set of modules, an upward import as
# (importer, imported). They are to be removed, not added to: an entry that no longer matches fails below.
ALLOWED_CIRCLES: set[frozenset[str]] = set()
ALLOWED_UPWARD: set[tuple[str, str]] = set()
# The floors below the model never import torch (the scheduler is tested without a model, `lmserve memory` answers
# without one); config asks torch for a CUDA device's free memory, only when the device is CUDA.
TORCH_FREE_FLOORS = ("leaves", "config", "core")
ALLOWED_TORCH = {"config.kv_budget"}
# modules that stand below their folder's floor (a noun the lower floors need, kept beside its capability)
FOLDER_FLOOR_EXCEPTIONS = {"lora.request"}


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name → its file, for every .py under src/lmserve (a package is its __init__.py)."""
    out = {}
    for path in sorted((src / "lmserve").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module → the lmserve modules it imports. `from pkg import name` is an edge to pkg.name when that is a
    module, else to pkg (its __init__ defines the name); the packages a dotted import passes through are not
    edges (importing a.b.c runs a/__init__.py, which is Python's doing, not a dependency of the importer)."""
    files = module_files(src)

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        edges: set[str] = set()
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [owner(f"{base}.{a.name}") if f"{base}.{a.name}" in files else owner(base)
                           for a in node.names]  # fmt: skip
            else:
                continue
            edges |= {t for t in targets if t is not None and t != mod}
        graph[mod] = edges
    return graph


def floor_of(mod: str) -> int:
    short = mod.removeprefix("lmserve.") if mod != "lmserve" else "lmserve"
    best, best_len = -1, -1
    for level, (_, patterns) in enumerate(FLOORS):
        for p in patterns:
            if (short == p or short.startswith(p + ".")) and len(p) > best_len:
                best, best_len = level, len(p)
    return best


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.add(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def _short(mods: set[str]) -> frozenset[str]:
    return frozenset(m.removeprefix("lmserve.") for m in mods)


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {
        (a.removeprefix("lmserve."), b.removeprefix("lmserve."))
        for a, targets in graph.items()
        for b in targets
        if floor_of(b) > floor_of(a)
    }


def test_every_module_has_a_floor() -> None:
    missing = sorted(m for m in module_files() if floor_of(m) < 0)
    assert not missing, f"modules with no floor in FLOORS (add them here and to docs/architecture.md): {missing}"


def test_no_import_circles() -> None:
    found = {_short(c) for c in circles(import_graph())}
    assert found - ALLOWED_CIRCLES == set(), f"import circles: {sorted(sorted(c) for c in found - ALLOWED_CIRCLES)}"
    stale = ALLOWED_CIRCLES - found
    assert not stale, f"ALLOWED_CIRCLES lists circles that are gone; remove them: {sorted(sorted(c) for c in stale)}"


def test_no_upward_imports() -> None:
    found = upward_imports(import_graph())
    names = [name for name, _ in FLOORS]
    bad = sorted(found - ALLOWED_UPWARD)
    assert not bad, "imports from a lower floor to a higher one: " + ", ".join(
        f"{a} ({names[floor_of('lmserve.' + a)]}) -> {b} ({names[floor_of('lmserve.' + b)]})" for a, b in bad
    )
    stale = ALLOWED_UPWARD - found
    assert not stale, f"ALLOWED_UPWARD lists imports that are gone; remove them: {sorted(stale)}"


def test_lower_floors_import_no_torch() -> None:
    names = [name for name, _ in FLOORS]
    bad = []
    for mod, path in module_files().items():
        if names[floor_of(mod)] not in TORCH_FREE_FLOORS or mod.removeprefix("lmserve.") in ALLOWED_TORCH:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                imported = [node.module or ""]
            if any(n == "torch" or n.startswith("torch.") for n in imported):
                bad.append(mod)
    assert not bad, f"modules on {TORCH_FREE_FLOORS} that import torch: {sorted(set(bad))}"


def folder_of(mod: str) -> str:
    """A module's folder: the package right under lmserve, or the loose module itself (`lmserve` for the root)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(folder_of(a), set()).update(folder_of(b) for b in targets if folder_of(b) != folder_of(a))
    return out


def test_no_folder_imports_a_folder_that_imports_it() -> None:
    """A folder is one room: no circle of imports between folders (or loose modules), however long."""
    found = sorted(sorted(c) for c in circles(folder_graph(import_graph())))
    assert not found, f"folders that import each other: {found}"


def test_each_folder_stands_on_one_floor() -> None:
    names = [name for name, _ in FLOORS]
    floors: dict[str, set[str]] = {}
    for mod in module_files():
        if mod.removeprefix("lmserve.") not in FOLDER_FLOOR_EXCEPTIONS:
            floors.setdefault(folder_of(mod), set()).add(names[floor_of(mod)])
    spread = {f: sorted(s) for f, s in floors.items() if len(s) > 1}
    assert not spread, f"folders whose modules stand on several floors: {spread}"


def test_floor_table_is_documented() -> None:
    """docs/architecture.md's Floors table names every entry of FLOORS, on its floor's row."""
    text = ARCHITECTURE_MD.read_text(encoding="utf-8")
    section = text.split("## Floors", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[2].strip(): line for line in section.splitlines() if line.startswith("| ")}
    for name, patterns in FLOORS:
        assert name in rows, f"docs/architecture.md's Floors table has no row {name!r}"
        missing = [p for p in patterns if f"`{p}`" not in rows[name]]
        assert not missing, f"docs/architecture.md's Floors row {name!r} does not name {missing}"


def test_graph_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The graph counts imports inside functions and under TYPE_CHECKING, and resolves relative ones."""
    pkg = tmp_path / "lmserve"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from lmserve.a import X\n")
    (pkg / "a.py").write_text("X = 1\ndef f():\n    from lmserve.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\nfrom . import c\n"
    )
    (pkg / "sub" / "c.py").write_text("import lmserve\n")
    graph = import_graph(tmp_path)
    assert graph["lmserve.a"] == {"lmserve.sub.b"}
    assert graph["lmserve.sub.b"] == {"lmserve.a", "lmserve.sub.c"}
    assert graph["lmserve.sub.c"] == {"lmserve"}
    assert graph["lmserve"] == {"lmserve.a"}
    assert {frozenset(c) for c in circles(graph)} == {
        frozenset({"lmserve", "lmserve.a", "lmserve.sub.b", "lmserve.sub.c"})
    }


def test_the_package_cli_and_bench_client_load_without_torch() -> None:
    """`import lmserve` loads its public names on first use, so the CLI's parser and the load generator (what
    `lmserve --help` and `lmserve bench serve` need) import neither torch nor transformers; every public name
    still resolves."""
    import subprocess
    import sys

    code = (
        "import sys, lmserve, lmserve.entrypoints.cli, lmserve.bench.loadgen, lmserve.bench.metrics\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "from lmserve import *\n"
        "import lmserve as L\n"
        "assert [getattr(L, n).__name__ for n in L.__all__] == L.__all__\n"
        "assert 'torch' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import lmserve

    try:
        lmserve.NoSuchName  # noqa: B018
    except AttributeError as e:
        assert "NoSuchName" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


MAX_MODULE_DOCSTRING_LINES = 6  # a few lines saying what the module is; detail goes to docs/<capability>.md


def long_module_docstrings(src: Path = SRC) -> list[str]:
    """'lines path' for each module (grpc_proto's generated stubs aside) whose docstring, closing quotes included,
    runs past MAX_MODULE_DOCSTRING_LINES lines."""
    out = []
    for path in module_files(src).values():
        if "grpc_proto" in path.parts:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        lines = doc.count("\n") + 1 if doc else 0
        if lines > MAX_MODULE_DOCSTRING_LINES:
            out.append(f"{lines} {path.relative_to(src)}")
    return out


def test_module_docstrings_are_short(tmp_path: Path) -> None:
    """Module docstrings say what the module is in at most 6 lines (measurements: docs/performance.md)."""
    (tmp_path / "lmserve").mkdir()
    (tmp_path / "lmserve" / "ok.py").write_text('"""One line."""\n')
    (tmp_path / "lmserve" / "long.py").write_text('"""Summary.\n\n' + "detail\n" * 4 + '"""\n')
    assert long_module_docstrings(tmp_path) == ["7 lmserve/long.py"]
    offenders = long_module_docstrings()
    assert not offenders, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines: {offenders}"
