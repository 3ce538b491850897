"""The package's layers import one way: what each lower layer may import, read from the source
with ``ast`` (no module is imported to check it).

- ``integrity/`` (checksums, the copier, verification) is the bottom layer;
- ``store/`` is passive: it imports only itself, ``integrity/`` and the leaf modules, starts
  no thread, and knows nothing of replication or lifecycle policy;
- every layer imports only itself, the layers below it and the leaf modules, which import
  only each other (errors, settings, fault points, the GC pause, topology, the persistent
  folder, whether the tmpfs is fit); no library module imports ``testing/`` (the harness for tests and benchmarks).
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mlcheckpoint"

# Modules every layer may use: they import nothing of mlcheckpoint but each other.
LEAVES = {"errors", "settings", "waiting", "_faults", "_ratelimit", "_gc", "topology",
          "persistent", "_words", "tmpfs"}
# Each layer, bottom up, with what it may import besides itself, the layers below and LEAVES.
LAYERS = ("integrity", "store", "dcp", "replication", "recovery")
ALSO = {"replication": {"history"}, "recovery": {"history"}}


def imported_modules(path: pathlib.Path, *, typing_only: bool = True) -> list[tuple[int, str]]:
    """(line, module under mlcheckpoint, e.g. "store.layout") of every import of ``path``
    that names the package (relative or absolute); others are left out. ``typing_only=False``
    leaves out the imports under ``if TYPE_CHECKING:`` (annotations only)."""
    return imports_in(path.read_text(), path.relative_to(PACKAGE).parent.parts, typing_only)


def imports_in(source: str, package: tuple[str, ...], typing_only: bool = True) -> list[tuple[int, str]]:
    """``imported_modules`` of ``source``, a module of the subpackage ``package``."""
    tree = ast.parse(source)
    skipped = set()
    if not typing_only:
        skipped = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for n in ast.walk(block)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - (node.level - 1)])
                module = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # "from . import x": each name is a module or a member
                    found += [(node.lineno, ".".join([*base, a.name])) for a in node.names]
                    continue
            elif (node.module or "").split(".")[0] == "mlcheckpoint":
                module = node.module.split(".", 1)[1] if "." in node.module else ""
            else:
                continue
            found.append((node.lineno, module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".", 1)[1]) for a in node.names
                      if a.name.startswith("mlcheckpoint.")]
    return found


def top(module: str) -> str:
    return module.split(".")[0]


def offending_imports(layer: str, allowed: set[str]) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / layer).glob("*.py")):
        for line, module in imported_modules(path):
            if top(module) not in allowed:
                bad.append(f"{layer}/{path.name}:{line} imports mlcheckpoint.{module}")
    return bad


def test_store_imports_only_itself_integrity_and_the_leaves():
    assert offending_imports("store", {"store", "integrity"} | LEAVES) == []


def test_integrity_imports_only_itself_and_the_leaves():
    assert offending_imports("integrity", {"integrity"} | LEAVES) == []


def test_every_layer_imports_only_itself_the_layers_below_and_the_leaves():
    bad = []
    for i, layer in enumerate(LAYERS):
        bad += offending_imports(layer, set(LAYERS[:i + 1]) | LEAVES | ALSO.get(layer, set()))
    assert bad == []


def test_the_library_never_imports_its_test_harness():
    bad = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
           if "testing" not in path.relative_to(PACKAGE).parts
           for line, module in imported_modules(path) if top(module) == "testing"]
    assert bad == []


def leaf_files(leaf: str) -> list[pathlib.Path]:
    """The files of a leaf: a module, or a package's modules (``settings/``)."""
    if (PACKAGE / leaf).is_dir():
        return sorted((PACKAGE / leaf).glob("*.py"))
    return [PACKAGE / f"{leaf}.py"] if (PACKAGE / f"{leaf}.py").exists() else []


def test_leaves_import_only_each_other():
    """At run time: ``errors`` names ``integrity.verify.CopyId`` in an annotation only, and
    ``tmpfs`` the store's ``JobPaths``."""
    bad = [f"{path.relative_to(PACKAGE)}:{line} imports mlcheckpoint.{module}"
           for leaf in sorted(LEAVES) for path in leaf_files(leaf)
           for line, module in imported_modules(path, typing_only=False)
           if top(module) not in LEAVES]
    assert bad == []
    assert leaf_files("settings") and leaf_files("tmpfs")  # both are checked


def test_no_store_module_imports_the_store_facade_back():
    """The store's parts form a DAG under ``LocalStore``: none imports ``local_store``."""
    bad = [f"store/{path.name}:{line}" for path in sorted((PACKAGE / "store").glob("*.py"))
           if path.name not in ("local_store.py", "__init__.py")
           for line, module in imported_modules(path)
           if module in ("store.local_store", "store")]
    assert bad == []


def test_store_starts_no_thread():
    """Threads start above the store (the copier's pool in integrity/, the lifecycle's
    warmer); the store only guards its own state with locks."""
    bad = []
    for path in sorted((PACKAGE / "store").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("Thread", "ThreadPoolExecutor", "Timer"):
                bad.append(f"store/{path.name}:{node.lineno} uses {node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module in ("threading", "concurrent.futures"):
                names = {a.name for a in node.names}
                if names & {"Thread", "ThreadPoolExecutor", "Timer"}:
                    bad.append(f"store/{path.name}:{node.lineno} imports {sorted(names)}")
    assert bad == []


def test_checksum_comparisons_live_in_one_file():
    """Every comparison of a digest with a recorded checksum is ``integrity/verify.py``'s."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "integrity" / "verify.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "")
                         for side in (node.left, *node.comparators) for n in ast.walk(side)}
                if names & {"checksum", "digest"}:
                    bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert bad == []


def test_the_import_reader_sees_relative_and_absolute_imports():
    """The checker itself: every form of import the package uses is seen, inside functions
    too."""
    source = ("from ..replication import sink\nfrom . import layout\nfrom .shards import ALIGN\n"
              "import mlcheckpoint.manager\nimport numpy\n"
              "def f():\n    from mlcheckpoint.lifecycle import Pins\n")
    assert sorted(m for _, m in imports_in(source, ("store",))) == [
        "lifecycle", "manager", "replication", "store.layout", "store.shards"]
