"""The package's layers import one way: what each lower layer may import, read from the source
with ``ast`` (no module is imported to check it).

- ``integrity/`` (checksums, the copier, verification) is the bottom layer;
- ``store/`` is passive: it imports only itself, ``integrity/`` and the leaf modules, starts
  no thread, and knows nothing of replication or lifecycle policy;
- every layer imports only itself, the layers below it and the leaf modules, which import
  only each other (errors, settings, fault points, the GC pause, topology, the persistent
  folder, whether the tmpfs is fit, the checkpoint group's all_gather); no library module
  imports ``testing/`` (the harness for tests and benchmarks);
- inside ``replication/``: the transport core (``core/``) imports no wire format (``tcp/``,
  ``pg/``) and nothing above it; no wire format imports the schedule (``schedule/``), the
  factory or the other wire format; the schedule imports only the core.
- ``dcp/`` reads other nodes through its own Protocol (``dcp/remote.py``), never through
  ``replication/`` or ``recovery/``;
- every comparison of checksums is ``integrity/verify.py``'s;
- the orchestrators (``manager/``: the manager, the save path, retention, ...) sit above every
  layer and no layer imports them; the top level holds only leaves, ``history.py``, the
  command line and the packages, so the tree shows the layers.

Every layer rule of the project is here, in this one file.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mlcheckpoint"

# Modules every layer may use: they import nothing of mlcheckpoint but each other.
LEAVES = {"errors", "settings", "waiting", "_faults", "_messages", "_gc", "topology",
          "persistent", "tmpfs", "collectives"}
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
    """Imports of the modules in ``layer`` (its subpackages too) that name a top-level module
    or package of mlcheckpoint outside ``allowed``."""
    bad = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in imported_modules(path):
            if top(module) not in allowed:
                bad.append(f"{path.relative_to(PACKAGE)}:{line} imports mlcheckpoint.{module}")
    return bad


def replication_imports(part: str) -> list[tuple[str, str]]:
    """(where, the part of replication/ imported: "core", "tcp", "factory", ...) for every
    import of another part of replication/ by the modules of ``replication/<part>/``."""
    found = []
    for path in sorted((PACKAGE / "replication" / part).rglob("*.py")):
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "replication" and len(parts) > 1 and parts[1] != part:
                found.append((f"{path.relative_to(PACKAGE)}:{line}", parts[1]))
    return found


def test_store_imports_only_itself_integrity_and_the_leaves():
    assert offending_imports("store", {"store", "integrity"} | LEAVES) == []


def test_integrity_imports_only_itself_and_the_leaves():
    assert offending_imports("integrity", {"integrity"} | LEAVES) == []


def test_every_layer_imports_only_itself_the_layers_below_and_the_leaves():
    bad = []
    for i, layer in enumerate(LAYERS):
        bad += offending_imports(layer, set(LAYERS[:i + 1]) | LEAVES | ALSO.get(layer, set()))
    assert bad == []


def test_the_transport_core_imports_no_wire_format():
    """``replication/core/`` (the interface, the sink, the request service, the budget, the
    keys) serves every transport: it imports none of them, nor the schedule above it."""
    assert (PACKAGE / "replication" / "core" / "service.py").exists()
    bad = [f"{where} imports replication.{part}" for where, part in replication_imports("core")]
    assert bad == []


def wire_formats() -> list[str]:
    """The packages of replication/ that are a wire format: all but the core and the schedule."""
    return sorted(d.name for d in (PACKAGE / "replication").iterdir()
                  if (d / "__init__.py").exists() and d.name not in ("core", "schedule"))


def test_no_wire_format_imports_the_schedule_or_another_wire_format():
    """A transport only moves bytes: ``tcp/`` and ``pg/`` (and any wire format added beside
    them) import the core alone, never the schedule (the replicator, rounds), the factory or
    each other."""
    assert {"tcp", "pg"} <= set(wire_formats())
    bad = [f"{where} imports replication.{part}" for wire in wire_formats()
           for where, part in replication_imports(wire) if part != "core"]
    assert bad == []


def test_the_schedule_sends_through_the_transport_interface():
    """``replication/schedule/`` knows transports only as ``core.Transport``."""
    bad = [f"{where} imports replication.{part}" for where, part in replication_imports("schedule")
           if part != "core"]
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
    """At run time (``tmpfs`` names the store's ``JobPaths`` in an annotation only)."""
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


def test_retention_and_the_lifecycle_import_nothing_of_replication_at_run_time():
    """The manager subscribes the lifecycle to the receive sink, and hands retention the
    replicator as a ``Protection``: neither ``manager/lifecycle.py`` nor ``manager/retention.py`` imports
    ``replication/`` but for annotations, so neither calls into the sink that calls them."""
    bad = [f"{name}:{line} imports mlcheckpoint.{module}" for name in ("lifecycle.py", "retention.py")
           for line, module in imported_modules(PACKAGE / "manager" / name, typing_only=False)
           if top(module) == "replication"]
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


# A value carries a checksum when it is named for one (checksum, digest, chunk_digests...).
CHECKSUM_WORDS = ("checksum", "digest")
# Calls whose result says something about their argument but carries none of its checksums.
MEASURES = {"len", "bool", "isinstance", "type", "id", "hash"}


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def own_nodes(scope: ast.AST):
    """The nodes of ``scope`` (a module or function) outside the functions defined in it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, FUNCTIONS):
            todo += ast.iter_child_nodes(node)


def assignments(scope: ast.AST) -> dict[str, list[ast.expr]]:
    """name -> the values it is assigned in ``scope`` itself."""
    assigned: dict[str, list[ast.expr]] = {}
    for a in own_nodes(scope):
        if isinstance(a, (ast.Assign, ast.AnnAssign)) and a.value is not None:
            for t in (a.targets if isinstance(a, ast.Assign) else [a.target]):
                if isinstance(t, ast.Name):
                    assigned.setdefault(t.id, []).append(a.value)
                elif isinstance(t, ast.Tuple) and isinstance(a.value, ast.Tuple):
                    for n, v in zip(t.elts, a.value.elts):  # x, y = a, b
                        if isinstance(n, ast.Name):
                            assigned.setdefault(n.id, []).append(v)
                # x, y = f(): each part is judged by its name alone
    return assigned


def checksum_comparisons(source: str) -> list[int]:
    """The lines of ``source`` where ``==`` or ``!=`` compares a value that carries a checksum,
    judged by what the value holds, not by the name of the comparison: a name or attribute named
    for a checksum, a call of a function named for one, a tuple, list, comprehension, subscript
    or copy of one, a name its function assigns one, and a call of a function of the module (or
    a lambda) that returns one (e.g. a manifest's layout as ``(offset, nbytes, checksum)``
    tuples)."""
    tree = ast.parse(source)
    # function name -> (what it returns, the names it assigns)
    returns: dict[str, tuple[list[ast.expr], dict[str, list[ast.expr]]]] = {}
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            returns[f.name] = ([r.value for r in own_nodes(f) if isinstance(r, ast.Return) and r.value],
                               assignments(f))
        elif isinstance(f, ast.Assign) and isinstance(f.value, ast.Lambda):
            returns.update({t.id: ([f.value.body], {}) for t in f.targets if isinstance(t, ast.Name)})

    def carries(e: ast.AST, assigned: dict[str, list[ast.expr]], seen: frozenset[str] = frozenset()) -> bool:
        if isinstance(e, (ast.Name, ast.Attribute)):
            name = e.id if isinstance(e, ast.Name) else e.attr
            if any(w in name.lower() for w in CHECKSUM_WORDS):
                return True
            if isinstance(e, ast.Name) and e.id not in seen:
                return any(carries(v, assigned, seen | {e.id}) for v in assigned.get(e.id, ()))
            return False
        if isinstance(e, ast.Call):
            func = e.func.id if isinstance(e.func, ast.Name) else getattr(e.func, "attr", "")
            if func in MEASURES:
                return False
            if any(w in func.lower() for w in CHECKSUM_WORDS):
                return True
            if func in returns and func not in seen:
                values, names = returns[func]
                return any(carries(v, names, seen | {func}) for v in values)
            return any(carries(a, assigned, seen) for a in e.args)  # list(...), sorted(...), tuple(...)
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return any(carries(x, assigned, seen) for x in e.elts)
        if isinstance(e, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return carries(e.elt, assigned, seen)
        if isinstance(e, (ast.Subscript, ast.Starred)):
            return carries(e.value, assigned, seen)
        return False

    found = set()
    for scope in (tree, *(f for f in ast.walk(tree) if isinstance(f, FUNCTIONS))):
        assigned = assignments(scope)  # a comparison is judged with its own function's names
        found |= {node.lineno for node in own_nodes(scope) if isinstance(node, ast.Compare)
                  and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)
                  and any(carries(side, assigned) for side in (node.left, *node.comparators))}
    return sorted(found)


def test_checksum_comparisons_live_in_one_file():
    """Every comparison of checksums, or of values that hold them, is ``integrity/verify.py``'s."""
    bad = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
           if path != PACKAGE / "integrity" / "verify.py"
           for line in checksum_comparisons(path.read_text())]
    assert bad == []


def test_the_checksum_rule_sees_what_a_comparison_compares():
    """The checker itself: a comparison of checksums is caught whatever it is called, and
    measuring a list of digests is not a comparison of them."""
    caught = {
        "a.checksum == b.checksum": 1,
        "digest_item(x) != m.checksum": 1,
        "(m.save_id, m.checksum) == other": 1,
        "lay = [(i.offset, i.checksum) for i in m.items]\nlay == other": 2,
        "def _layout(m):\n    return [(i.offset, i.nbytes, i.checksum) for i in m.items]\n"
        "held.save_id == m.save_id and _layout(held) == _layout(m)": 3,
        "key = lambda i: (i.offset, i.checksum)\nkey(a) == key(b)": 2,
        "sorted(chunk_digests) == want": 1,
        "got, want = hash_of(x), m.checksum\ngot == want": 2,
    }
    for source, line in caught.items():
        assert checksum_comparisons(source) == [line], source
    for source in ("len(chunk_digests) == 1", "a.offset == b.offset", "m.save_id != other.save_id",
                   "isinstance(digest, int) == True",
                   "offset, digest = append(x)\noffset == 0",
                   "def f():\n    known = staged_checksum(x)\ndef g(d):\n    known = d.get(0)\n    known[0] == 3"):
        assert checksum_comparisons(source) == [], source


def test_layer_2_reads_other_nodes_through_its_own_protocol():
    """``dcp/`` reaches other nodes only through ``remote.py``'s ``RemoteReads`` (which
    ``recovery/holders.py`` implements): it imports neither ``replication/`` nor ``recovery/``."""
    bad = [f"dcp/{path.name}:{line} imports mlcheckpoint.{module}"
           for path in sorted((PACKAGE / "dcp").glob("*.py"))
           for line, module in imported_modules(path) if top(module) in ("replication", "recovery")]
    assert bad == []


def test_the_import_reader_sees_relative_and_absolute_imports():
    """The checker itself: every form of import the package uses is seen, inside functions
    too."""
    source = ("from ..replication import sink\nfrom . import layout\nfrom .shards import ALIGN\n"
              "import mlcheckpoint.manager\nimport numpy\n"
              "def f():\n    from mlcheckpoint.manager.lifecycle import Pins\n")
    assert sorted(m for _, m in imports_in(source, ("store",))) == [
        "manager", "manager.lifecycle", "replication", "store.layout", "store.shards"]


def test_a_ranks_node_and_its_leader_come_from_topology_only():
    """Which node a rank is on and which rank speaks for a node are ``Topology``'s answers
    (``node_of``, ``ranks_of_node``, ``is_node_leader``): nobody else divides ranks or tests
    ``local_rank`` against 0."""
    by_hand = ("local_rank == 0", "local_rank != 0", "// self.local_world_size",
               "// topology.local_world_size", "// self.topology.local_world_size",
               "// t.local_world_size", "// self.topo.local_world_size")
    bad = [f"{path.relative_to(PACKAGE)}:{i}" for path in sorted(PACKAGE.rglob("*.py"))
           if path != PACKAGE / "topology.py"
           for i, line in enumerate(path.read_text().splitlines(), 1)
           if any(pattern in line for pattern in by_hand)]
    assert bad == []


def test_no_layer_imports_the_orchestrators():
    """``manager/`` builds the layers and passes them in; nothing below calls up into it (the
    framework integrations sit above it: they wrap ``CheckpointManager``)."""
    bad = [f"{path.relative_to(PACKAGE)}:{line} imports mlcheckpoint.{module}"
           for layer in LAYERS
           for path in sorted((PACKAGE / layer).rglob("*.py"))
           for line, module in imported_modules(path, typing_only=False) if top(module) == "manager"]
    bad += [f"{leaf}:{line} imports mlcheckpoint.{module}" for leaf in sorted(LEAVES)
            for path in leaf_files(leaf) for line, module in imported_modules(path) if top(module) == "manager"]
    assert bad == []


def test_the_top_level_holds_leaves_history_the_command_line_and_packages():
    """An orchestrator added at the top level would hide the layers again: it goes in ``manager/``."""
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules - LEAVES - {"history", "cli"} == set()
