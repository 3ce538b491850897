"""Settings (mlcheckpoint.settings) and their use by LocalStore and CheckpointManager: job id,
local directory, keep, memory limit, replication bandwidth and interface. A bad setting is a
ConfigError that names it and says what to do, never a raw exception later."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import typing

import pytest
import torch
from helpers import mounted_tmpfs, torchtitan_integration

import mlcheckpoint
from mlcheckpoint import (
    CapacityError,
    CheckpointManager,
    ConfigError,
    _gc,
    settings,
)
from mlcheckpoint.replication.core import network
from mlcheckpoint.replication.factory import TRANSPORTS
from mlcheckpoint.settings import (
    DEFAULT_LOCAL_DIR,
    DEPRECATED_KEYWORDS,
    ENV_VARS,
    SETTINGS,
    Launcher,
    Options,
    ReplicationOptions,
    Timeouts,
    Tuning,
    default,
    native_loop,
    parse_bandwidth,
    parse_bytes,
    resolve_job_id,
    resolve_local_dir,
    resolve_memory_limit,
    validate_job_id,
    validate_keep,
    variable_text,
)
from mlcheckpoint.store import LocalStore
from mlcheckpoint.testing import internals
from mlcheckpoint.tmpfs import _MEMORY_FS, filesystem_type
from mlcheckpoint.topology import Topology

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
MiB = 1 << 20


# ---------------------------------------------------------------- job id

def test_explicit_job_id_wins_over_every_env_var(clean_env):
    clean_env.setenv("MLCHECKPOINT_JOB_ID", "from-mlckpt")
    clean_env.setenv("TORCHELASTIC_RUN_ID", "from-elastic")
    clean_env.setenv("SLURM_JOB_ID", "12345")
    assert resolve_job_id("explicit") == "explicit"


def test_job_id_env_order(clean_env):
    clean_env.setenv("SLURM_JOB_ID", "12345")
    assert resolve_job_id() == "12345"
    clean_env.setenv("TORCHELASTIC_RUN_ID", "elastic-run")
    assert resolve_job_id() == "elastic-run"
    clean_env.setenv("MLCHECKPOINT_JOB_ID", "mine")
    assert resolve_job_id() == "mine"


def test_torchelastic_run_id_none_is_ignored(clean_env):
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    clean_env.setenv("SLURM_JOB_ID", "777")
    assert resolve_job_id() == "777"
    clean_env.delenv("SLURM_JOB_ID")
    with pytest.raises(ConfigError):
        resolve_job_id()


def test_empty_env_value_is_skipped(clean_env):
    clean_env.setenv("MLCHECKPOINT_JOB_ID", "")
    clean_env.setenv("SLURM_JOB_ID", "42")
    assert resolve_job_id() == "42"


def test_no_job_id_gives_guidance(clean_env):
    with pytest.raises(ConfigError) as ei:
        resolve_job_id()
    msg = str(ei.value)
    for hint in ("job_id=", "MLCHECKPOINT_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        assert hint in msg


def test_store_without_job_id_raises_config_error_and_creates_nothing(clean_env, store_dir):
    with pytest.raises(ConfigError):
        LocalStore(store_dir)
    assert os.listdir(store_dir) == []


@pytest.mark.parametrize("bad", ["", "a/b", "/abs", "..", ".", "../escape", "x/../y", ".hidden",
                                 "-dash", "sp ace", "new\nline", "a" * 129, "ünïcode"])
def test_invalid_job_ids_rejected(bad, clean_env):
    with pytest.raises(ConfigError) as ei:
        validate_job_id(bad)
    assert "invalid job id" in str(ei.value)
    with pytest.raises(ConfigError):
        resolve_job_id(bad)


@pytest.mark.parametrize("bad", ["a/b", "..", "x y"])
def test_invalid_job_id_from_env_rejected(bad, clean_env):
    clean_env.setenv("MLCHECKPOINT_JOB_ID", bad)
    with pytest.raises(ConfigError):
        resolve_job_id()


def test_invalid_job_id_never_escapes_local_dir(clean_env, store_dir):
    inner = os.path.join(store_dir, "inner")
    with pytest.raises(ConfigError):
        LocalStore(inner, "../outside")
    assert not os.path.exists(os.path.join(store_dir, "outside"))


@pytest.mark.parametrize("good", ["a", "job-1", "run_2024.01", "A" * 128, "12345", "x..y"])
def test_valid_job_ids_accepted(good, clean_env):
    assert validate_job_id(good) == good
    assert resolve_job_id(good) == good


def test_non_string_explicit_job_id_is_stringified(clean_env):
    assert resolve_job_id(12345) == "12345"


# ---------------------------------------------------------------- local dir

def test_local_dir_default(clean_env):
    assert resolve_local_dir() == DEFAULT_LOCAL_DIR == "/dev/shm/mlcheckpoint"


def test_local_dir_env_then_explicit(clean_env, store_dir):
    env_dir = os.path.join(store_dir, "from-env")
    clean_env.setenv("MLCHECKPOINT_LOCAL_DIR", env_dir)
    assert resolve_local_dir() == env_dir
    explicit = os.path.join(store_dir, "explicit")
    assert resolve_local_dir(explicit) == explicit


def test_local_dir_is_made_absolute(clean_env, store_dir, monkeypatch):
    monkeypatch.chdir(store_dir)
    assert resolve_local_dir("rel") == os.path.join(store_dir, "rel")
    clean_env.setenv("MLCHECKPOINT_LOCAL_DIR", "rel-env")
    assert resolve_local_dir() == os.path.join(store_dir, "rel-env")


def test_local_store_uses_env_settings(clean_env, store_dir):
    local = os.path.join(store_dir, "local")
    clean_env.setenv("MLCHECKPOINT_LOCAL_DIR", local)
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    clean_env.setenv("SLURM_JOB_ID", "9876")
    store = LocalStore()
    try:
        assert store.local_dir == local
        assert store.job_id == "9876"
        assert store.job_dir == os.path.join(local, "9876")
        assert os.path.isdir(store.job_dir)
    finally:
        store.close()


# ---------------------------------------------------------------- local dir: clear errors

def manager(local_dir, **kw) -> CheckpointManager:
    return CheckpointManager(job_id="job-config", local_dir=local_dir, replication="none", **kw)


def test_local_dir_that_is_a_file_is_a_config_error(store_dir):
    path = os.path.join(store_dir, "a-file")
    with open(path, "w") as f:
        f.write("not a directory")
    for local_dir in (path, os.path.join(path, "below")):
        with pytest.raises(ConfigError) as ei:
            manager(local_dir)
        assert path in str(ei.value) and "not a directory" in str(ei.value)
        assert "MLCHECKPOINT_LOCAL_DIR" in str(ei.value)
    with open(path) as f:
        assert f.read() == "not a directory"


@pytest.mark.parametrize("job_dir_exists", [False, True])
def test_read_only_local_dir_is_a_config_error(store_dir, job_dir_exists):
    mnt = os.path.join(store_dir, "ro")
    with mounted_tmpfs(mnt, "size=1m,mode=0700"):
        if job_dir_exists:  # a restart finds its directory, now on a read-only mount
            LocalStore(mnt, "job-config").close()
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
        with pytest.raises(ConfigError) as ei:
            manager(mnt)
        msg = str(ei.value)
        assert mnt in msg and "read-only" in msg and "local_dir" in msg


def test_empty_local_dir_is_refused_and_nothing_lands_in_the_cwd(store_dir, monkeypatch):
    monkeypatch.chdir(store_dir)
    with pytest.raises(ConfigError) as ei:
        manager("")
    assert "local_dir=''" in str(ei.value) and DEFAULT_LOCAL_DIR in str(ei.value)
    with pytest.raises(ConfigError):
        resolve_local_dir("")
    assert os.listdir(store_dir) == []


def _directory_not_in_memory():
    """A fresh directory on a filesystem that is not tmpfs/ramfs, or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    for parent in ("/var/tmp", here):
        fs = filesystem_type(parent) if os.path.isdir(parent) else None
        if fs is not None and fs not in _MEMORY_FS:
            return tempfile.mkdtemp(prefix="mlckpt-test-disk-", dir=parent)
    return None


def test_local_dir_not_on_tmpfs_warns_once(caplog):
    path = _directory_not_in_memory()
    if path is None:
        pytest.skip("no directory outside tmpfs/ramfs to try")
    try:
        with caplog.at_level(logging.WARNING, logger="mlcheckpoint"):
            for _ in range(2):
                LocalStore(path, "job-config").close()
        warnings = [r for r in caplog.records if "not tmpfs" in r.getMessage()]
        assert len(warnings) == 1
        assert path in warnings[0].getMessage() and "memory speed" in warnings[0].getMessage()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_local_dir_in_memory_does_not_warn(store_dir, caplog):
    ramfs = os.path.join(store_dir, "ramfs")
    os.mkdir(ramfs)
    mounted = subprocess.run(["mount", "-t", "ramfs", "ramfs", ramfs], check=False,
                             capture_output=True).returncode == 0
    try:
        with caplog.at_level(logging.WARNING, logger="mlcheckpoint"):
            LocalStore(store_dir, "job-config").close()  # tmpfs (/dev/shm)
            if mounted:
                LocalStore(ramfs, "job-config").close()
        assert not [r for r in caplog.records if "not tmpfs" in r.getMessage()]
    finally:
        if mounted:
            subprocess.run(["umount", "-l", ramfs], check=False)


# ---------------------------------------------------------------- keep

@pytest.mark.parametrize("bad", [1.5, "2", True, 0, -1, None, 2.0])
def test_keep_must_be_a_positive_int(store_dir, bad):
    with pytest.raises(ConfigError) as ei:
        manager(os.path.join(store_dir, "local"), keep=bad)
    assert f"keep={bad!r}" in str(ei.value)
    assert not os.path.exists(os.path.join(store_dir, "local"))  # refused before anything


def test_keep_accepts_ints():
    import numpy as np
    assert validate_keep(1) == 1 and validate_keep(3) == 3 and validate_keep(np.int64(2)) == 2


# ---------------------------------------------------------------- memory limit

@pytest.mark.parametrize("text, nbytes", [
    ("8589934592", 8 << 30), ("8G", 8 << 30), ("8GiB", 8 << 30), ("8gi", 8 << 30),
    ("8GB", 8 * 10**9), ("8 gb", 8 * 10**9), ("512MiB", 512 << 20), ("512M", 512 << 20),
    ("500MB", 500 * 10**6), ("64K", 64 << 10), ("64kB", 64000), ("1.5T", 3 << 39),
    ("1TB", 10**12), (" 4096 ", 4096), ("4096B", 4096), (4096, 4096)])
def test_sizes_with_units(text, nbytes):
    assert parse_bytes(text, "x") == nbytes


@pytest.mark.parametrize("bad", ["", "lots", "8 GBs", "-1", "0", "1e9", "8GB8", True, 0, -5])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ConfigError) as ei:
        parse_bytes(bad, "memory_limit_bytes")
    assert "memory_limit_bytes" in str(ei.value) and "GiB" in str(ei.value)


def test_memory_limit_env_with_units(store_dir, monkeypatch):
    monkeypatch.setenv("MLCHECKPOINT_MEMORY_LIMIT", "8GB")
    with manager(store_dir) as ckpt:
        assert internals(ckpt).store.memory_limit_bytes == 8 * 10**9
    store = LocalStore(store_dir, "job-config")  # the same variable, read the same way
    assert store.memory_limit_bytes == 8 * 10**9
    store.close()
    monkeypatch.setenv("MLCHECKPOINT_MEMORY_LIMIT", "")
    assert resolve_memory_limit() is None
    assert resolve_memory_limit("1MiB") == MiB  # the argument wins over the variable


def test_bad_memory_limit_env_is_a_config_error(store_dir, monkeypatch):
    monkeypatch.setenv("MLCHECKPOINT_MEMORY_LIMIT", "eight gigs")
    with pytest.raises(ConfigError) as ei:
        manager(os.path.join(store_dir, "local"))
    assert "MLCHECKPOINT_MEMORY_LIMIT='eight gigs'" in str(ei.value)
    assert not os.path.exists(os.path.join(store_dir, "local"))


def test_memory_limit_argument_with_units_is_enforced(store_dir):
    with manager(store_dir, memory_limit_bytes="256KiB") as ckpt:
        assert internals(ckpt).store.memory_limit_bytes == 256 << 10
        with pytest.raises(CapacityError):
            ckpt.save({"w": torch.zeros(MiB // 4)}, 1)


# ---------------------------------------------------------------- a pickled value too large

@pytest.mark.parametrize("how", ["save", "async_save"])
def test_pickled_value_larger_than_free_space_is_a_capacity_error(store_dir, how):
    """DCP pickles non-tensor values (byte items) and they are appended after the tensors:
    one larger than the tmpfs's free space is a CapacityError, and the earlier step stays."""
    with (mounted_tmpfs(os.path.join(store_dir, "small"), "size=4m,mode=0700") as mnt,
          manager(mnt, keep=2) as ckpt):
        ckpt.save({"w": torch.arange(1024.0), "blob": b"small"}, 1)
        big = {"w": torch.arange(1024.0) + 1, "blob": os.urandom(6 * MiB)}
        with pytest.raises(CapacityError) as ei:
            if how == "save":
                ckpt.save(big, 2)
            else:
                ckpt.async_save(big, 2).result(timeout=60)
        assert mnt in str(ei.value) and ei.value.needed > 6 * MiB
        ckpt.wait()
        assert internals(ckpt).store.inventory.complete_steps() == [1]
        out = {"w": torch.zeros(1024), "blob": b""}
        assert ckpt.resume(out).step == 1
        assert torch.equal(out["w"], torch.arange(1024.0)) and out["blob"] == b"small"


# ---------------------------------------------------------------- persistent=True needs a folder

@pytest.mark.parametrize("how", ["save", "async_save"])
def test_persistent_save_without_persistent_dir_is_refused_at_the_call(store_dir, how):
    """persistent=True without persistent_dir is a ConfigError when called, before anything is
    staged: no step is left pinned, so retention still keeps only ``keep`` steps."""
    with manager(store_dir, keep=1) as ckpt:
        for step in range(4):
            state = {"w": torch.full((1024,), float(step))}
            with pytest.raises(ConfigError, match="persistent_dir"):
                getattr(ckpt, how)(state, step, persistent=True)
            ckpt.async_save(state, step).result(timeout=60)
        ckpt.wait()
        assert internals(ckpt).store.inventory.steps() == [3]


# ---------------------------------------------------------------- one declaration

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "configuration.md")
PACKAGE = os.path.dirname(os.path.abspath(mlcheckpoint.__file__))
MANAGER_SETTINGS = [s for s in SETTINGS if s.group == "manager"]
REPLICATION_SETTINGS = [s for s in SETTINGS if s.group == "replication"]


def configuration_doc():
    """scripts/configuration_doc.py, which renders the tables of docs/configuration.md."""
    path = os.path.join(os.path.dirname(DOC), "..", "scripts", "configuration_doc.py")
    spec = importlib.util.spec_from_file_location("configuration_doc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_manager_arguments_are_the_declared_ones_with_their_defaults():
    """CheckpointManager's keywords, Options' and ReplicationOptions' fields and their defaults
    all come from SETTINGS: a field that has a variable defaults to None (unset: the variable,
    else the declared default); one without defaults to the declared default itself."""
    params = dict(inspect.signature(CheckpointManager.__init__).parameters)
    params.pop("self")
    keywords = [s.name for s in SETTINGS if s.keyword]
    assert list(params) == [*keywords, "replication", "options", "deprecated"]  # same order
    for s in SETTINGS:
        if s.keyword:
            assert params[s.name].default == (None if s.env else s.default), s.name
    assert [f.name for f in dataclasses.fields(Options)] == [
        *(s.name for s in MANAGER_SETTINGS), "replication"]
    assert [f.name for f in dataclasses.fields(ReplicationOptions)] == [
        s.attribute for s in REPLICATION_SETTINGS]
    for group, holder in ((MANAGER_SETTINGS, Options()), (REPLICATION_SETTINGS, ReplicationOptions())):
        for s in group:
            assert getattr(holder, s.attribute) == (None if s.env else s.default), s.name
    assert set(settings.REPLICATION_MODES) == {*TRANSPORTS, "none"}
    assert typing.get_args(typing.get_type_hints(ReplicationOptions)["mode"]) == \
        settings.REPLICATION_MODES


def test_the_doc_tables_are_generated_from_the_declaration():
    """docs/configuration.md's tables of arguments, ReplicationOptions' fields, variables and
    timeouts are what scripts/configuration_doc.py makes from SETTINGS; every variable is in
    the doc."""
    doc = configuration_doc()
    with open(DOC) as f:
        text = f.read()
    assert doc.render_doc(text) == text, "run python scripts/configuration_doc.py"
    for s in SETTINGS:
        if s.env:
            assert f"| `{s.env}` | {doc.variable_cell(s)} |" in text, s.env
        if s.keyword or s.group == "replication":
            assert f"| `{s.attribute}` | {doc.argument_cell(s)} |" in text, s.name
    assert set(re.findall(r"MLCHECKPOINT_\w+", text)) <= set(ENV_VARS)


def _library_modules():
    for root, _, files in os.walk(PACKAGE):
        if os.path.relpath(root, PACKAGE).split(os.sep)[0] == "testing":
            continue  # the emulated cluster builds its children's environment: not settings
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    yield os.path.relpath(path, PACKAGE), f.read()


_ENVIRONMENT = ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv")


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that touch the process environment: os.environ, os.getenv,
    os.putenv, or ``environ``/``getenv`` imported from os."""
    lines = []
    for node in ast.walk(tree):
        attribute = isinstance(node, ast.Attribute) and node.attr in _ENVIRONMENT
        imported = isinstance(node, ast.ImportFrom) and node.module == "os" and any(
            a.name in _ENVIRONMENT for a in node.names)
        if attribute or imported:
            lines.append(node.lineno)
    return lines


def test_no_library_module_but_settings_reads_the_environment():
    """Only settings/declared.py reads os.environ; every other module is handed its settings.
    The fault points (_faults.py, test hooks read at each check) and the rest of settings/ may
    ask settings.variable_text, and nothing else does."""
    readers, raw_text, named = {}, [], set()
    for path, text in _library_modules():
        tree = ast.parse(text, path)
        named |= set(re.findall(r"MLCHECKPOINT_[A-Z_]+", text))
        if path != os.path.join("settings", "declared.py") and _environment_reads(tree):
            readers[path] = _environment_reads(tree)
        calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                 for n in ast.walk(tree) if isinstance(n, ast.Call)}
        if "variable_text" in calls and path != "_faults.py" and not path.startswith("settings"):
            raw_text.append(path)
    assert readers == {}, readers
    assert raw_text == []
    assert named <= set(ENV_VARS)
    assert _environment_reads(ast.parse("import os\nos.environ.get('X')\nfrom os import getenv"))
    with pytest.raises(KeyError):
        variable_text("MLCHECKPOINT_NOT_A_SETTING")


def test_no_declared_timeout_is_written_again_as_a_default():
    """The 60 s replication timeout (and the other timeouts) are written once, in SETTINGS:
    a parameter default anywhere else in the library names them through settings.default."""
    timeouts = {float(s.default) for s in SETTINGS
                if s.group == "timeouts" or s.name == "replication_timeout"}
    found = []
    for path, text in _library_modules():
        if path == os.path.join("settings", "declared.py"):
            continue
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.arguments):
                for arg, value in zip(node.args[len(node.args) - len(node.defaults):] + node.kwonlyargs,
                                      node.defaults + node.kw_defaults, strict=True):
                    if ("timeout" in arg.arg and isinstance(value, ast.Constant)
                            and isinstance(value.value, (int, float)) and value.value in timeouts):
                        found.append(f"{path}:{value.lineno} {arg.arg}={value.value}")
    assert found == []


def test_documented_defaults_are_the_defaults(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    assert resolve_local_dir() == default("local_dir") == DEFAULT_LOCAL_DIR
    assert Tuning.from_env() == Tuning(copy_threads=Tuning.from_env().copy_threads)
    assert 1 <= Tuning.from_env().copy_threads <= 4
    assert native_loop() is _gc.enabled() is True
    assert settings.tuning().min_stripe_bytes == 64 << 20
    options = Options(job_id="j", local_dir="/dev/shm/x").resolved()
    assert options == Options(job_id="j", local_dir="/dev/shm/x", replication=ReplicationOptions(
        streams=4, bandwidth="auto", replicas=1, copies="auto"))
    assert (options.replication.bandwidth, options.replication.streams) == ("auto", 4)
    assert Launcher.from_env() == Launcher()
    assert Topology.detect(Launcher()) == Topology()
    assert Timeouts().replication == default("replication_timeout") == 60.0


def test_the_launcher_is_read_once_and_handed_to_the_topology(monkeypatch):
    for name, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                        "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "1234",
                        "TORCHELASTIC_RESTART_COUNT": "2"}.items():
        monkeypatch.setenv(name, value)
    launcher = Launcher.from_env()
    assert launcher == Launcher(rank=5, world_size=8, local_world_size=4,
                                master_addr="10.1.2.3", master_port=1234, restart_count="2")
    assert Topology.detect(launcher) == Topology(5, 8, 1, 4, 1, 2, "10.1.2.3", 1234)


def test_tuning_is_read_from_the_environment_unless_installed(monkeypatch):
    monkeypatch.setenv("MLCHECKPOINT_COPY_THREADS", "3")
    monkeypatch.setenv("MLCHECKPOINT_PAUSE_GC", "0")
    assert settings.tuning() == Tuning(copy_threads=3, pause_gc=False)
    with settings.tuned(copy_threads=1) as t:
        assert settings.tuning() is t and t.copy_threads == 1 and not t.pause_gc
    assert settings.tuning().copy_threads == 3


# ---------------------------------------------------------------- framework configs

def test_torchtitan_config_offers_every_manager_setting_with_its_default(monkeypatch):
    torchtitan = torchtitan_integration(monkeypatch)
    config = torchtitan.MemoryCheckpointManager.Config
    fields = {f.name: f for f in dataclasses.fields(config)}
    for s in MANAGER_SETTINGS:
        name = "memory_limit" if s.name == "memory_limit_bytes" else s.name
        assert name in fields, name
        assert fields[name].default == (None if s.env else s.default), name
    assert fields["replication"].default_factory() == ReplicationOptions()


def test_lightning_strategy_offers_every_manager_setting_with_its_default():
    lightning = pytest.importorskip("mlcheckpoint.integrations.lightning")
    params = inspect.signature(lightning.MLCheckpointStrategy.__init__).parameters
    for s in MANAGER_SETTINGS:
        name = "memory_limit" if s.name == "memory_limit_bytes" else s.name
        assert params[name].default == (None if s.env else s.default), name
    assert params["replication"].default is None  # ReplicationOptions(): every field's default


def test_framework_configs_take_replication_options_and_the_flat_fields_still_work(monkeypatch):
    """torchtitan's Config and the Lightning strategy group replication as the manager does;
    their flat fields of the last release warn and land in the same ReplicationOptions."""
    torchtitan = torchtitan_integration(monkeypatch)
    config = torchtitan.MemoryCheckpointManager.Config
    grouped = ReplicationOptions(mode="pg", streams=3, replicas=2)
    assert config(replication=grouped).replication == grouped
    assert config(replication="none").replication == ReplicationOptions(mode="none")
    with pytest.warns(DeprecationWarning, match=r"replication_streams=.*ReplicationOptions\(streams="):
        flat = config(replication="pg", replication_streams=3, replicas=2)
    assert flat.replication == grouped and flat.replication_streams is None
    lightning = pytest.importorskip("mlcheckpoint.integrations.lightning")
    with pytest.warns(DeprecationWarning, match=r"replicas=.*ReplicationOptions\(replicas="):
        strategy = lightning.MLCheckpointStrategy(replication="pg", replication_streams=3, replicas=2)
    assert strategy._options.replication == grouped


@pytest.mark.parametrize("var, value", [
    ("MLCHECKPOINT_MEMORY_LIMIT", "12x"), ("MLCHECKPOINT_TCP_STREAMS", "lots"),
    ("MLCHECKPOINT_TCP_STREAMS", "17"), ("MLCHECKPOINT_TCP_MIN_STRIPE", "0"),
    ("MLCHECKPOINT_COPY_THREADS", "two"), ("MLCHECKPOINT_COPY_THREADS", "0"),
    ("MLCHECKPOINT_NATIVE", "maybe"), ("MLCHECKPOINT_PAUSE_GC", "off please"),
    ("MLCHECKPOINT_JOB_ID", "a/b"), ("RANK", "first"), ("LOCAL_RANK", "-1"),
    ("LOCAL_WORLD_SIZE", "2.5"), ("MLCHECKPOINT_REPLICATION_BANDWIDTH", "fast"),
    ("MLCHECKPOINT_REPLICATION_BANDWIDTH", "-5MB/s"), ("MLCHECKPOINT_REPLICATION_IFNAME", "nosuch0"),
    ("MLCHECKPOINT_REPLICATION_IFNAME", "../eth0"), ("MLCHECKPOINT_DP_COPIES", "sometimes")])
def test_bad_variable_is_a_config_error_at_construction(store_dir, monkeypatch, var, value):
    """Every variable is parsed when the manager is built, also those read later (copy threads,
    streams, the gc pause): a bad value is a ConfigError naming it, before anything is written."""
    monkeypatch.setenv(var, value)
    local = os.path.join(store_dir, "local")
    with pytest.raises(ConfigError) as ei:
        CheckpointManager(local_dir=local, replication="none",
                          **({} if var == "MLCHECKPOINT_JOB_ID" else {"job_id": "job-config"}))
    assert var in str(ei.value) and repr(value) in str(ei.value), str(ei.value)
    assert not os.path.exists(local)


@pytest.mark.slow  # (a fresh interpreter: the package is imported already in this one)
@pytest.mark.parametrize("var", ["MLCHECKPOINT_COPY_THREADS", "MLCHECKPOINT_NATIVE",
                                 "MLCHECKPOINT_PAUSE_GC", "MLCHECKPOINT_TCP_MIN_STRIPE"])
def test_a_bad_process_setting_never_fails_the_import_only_the_construction(store_dir, var):
    """The copier's C loop is bound when its module is imported. That import once resolved
    every process setting, so ``MLCHECKPOINT_COPY_THREADS=0 python train.py`` failed at
    ``import mlcheckpoint`` (and ``mlcheckpoint ls`` with it), not at construction as this
    file's other tests and configuration.md say."""
    script = (
        "import mlcheckpoint, sys\n"
        "from mlcheckpoint import CheckpointManager, ConfigError\n"
        "try:\n"
        f"    CheckpointManager(job_id='j', local_dir={os.path.join(store_dir, 'local')!r}, "
        "replication='none')\n"
        "except ConfigError as e:\n"
        "    print('refused:', e)\n"
        "    sys.exit(3)\n")
    env = {**os.environ, var: "nonsense"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=False, timeout=120)
    assert run.returncode == 3, run.stderr[-2000:]
    assert f"{var}='nonsense'" in run.stdout and not os.path.exists(os.path.join(store_dir, "local"))


@pytest.mark.parametrize("setting, value", [
    ("mode", "udp"), ("timeout", 0), ("timeout", float("nan")), ("timeout", "60"),
    ("streams", 0), ("streams", 17), ("streams", True), ("host", ""),
    ("bandwidth", "fast"), ("bandwidth", -1), ("bandwidth", True), ("bandwidth", "1 furlong/s"),
    ("interface", ""), ("replicas", 0), ("failure_domain", ""), ("copies", "on"),
    ("copies", False)])
def test_bad_replication_option_is_a_config_error_naming_it(store_dir, setting, value):
    """Checked when the ReplicationOptions is made, before any manager exists."""
    with pytest.raises(ConfigError) as ei:
        ReplicationOptions(**{setting: value})
    assert f"ReplicationOptions.{setting}={value!r}" in str(ei.value)


@pytest.mark.parametrize("setting, value", [("keep", 0), ("keep", None), ("replication", "udp")])
def test_bad_argument_is_a_config_error_naming_it(store_dir, setting, value):
    local = os.path.join(store_dir, "local")
    kw = {"job_id": "job-config", "local_dir": local, "replication": "none", setting: value}
    with pytest.raises(ConfigError) as ei:
        CheckpointManager(**kw)
    assert f"={value!r}" in str(ei.value)
    assert not os.path.exists(local)


def test_an_interface_that_is_not_here_is_refused_at_construction(store_dir):
    local = os.path.join(store_dir, "local")
    with pytest.raises(ConfigError, match="'nosuch0' is not a network interface"):
        CheckpointManager(job_id="job-config", local_dir=local,
                          replication=ReplicationOptions(mode="none", interface="nosuch0"))
    assert not os.path.exists(local)


def test_arguments_win_over_variables_and_are_kept_on_the_manager(store_dir, monkeypatch):
    monkeypatch.setenv("MLCHECKPOINT_TCP_STREAMS", "8")
    monkeypatch.setenv("MLCHECKPOINT_REPLICATION_HOST", "10.0.0.7")
    from_env = Options(job_id="j", local_dir=store_dir).resolved()
    assert (from_env.replication.streams, from_env.replication.host) == (8, "10.0.0.7")
    explicit = Options(job_id="j", local_dir=store_dir, replication=ReplicationOptions(
        streams=2, host="127.0.0.1")).resolved()
    assert (explicit.replication.streams, explicit.replication.host) == (2, "127.0.0.1")
    with manager(store_dir, keep=3, memory_limit_bytes="1GiB") as ckpt:
        assert ckpt.options == Options(
            job_id="job-config", local_dir=store_dir, keep=3, memory_limit_bytes=1 << 30,
            replication=ReplicationOptions(mode="none", host="10.0.0.7", streams=8,
                                           bandwidth="auto", replicas=1, copies="auto"))
        assert internals(ckpt).store.memory_limit_bytes == 1 << 30


def test_one_options_object_is_the_same_as_the_keywords(store_dir):
    """CheckpointManager(options=Options(...)) builds what the keywords build; it takes no
    other setting beside it."""
    options = Options(job_id="job-config", local_dir=store_dir, keep=3,
                      replication=ReplicationOptions(mode="none", streams=2))
    with CheckpointManager(options=options) as ckpt:
        assert ckpt.options == options.resolved()
        assert ckpt.options.keep == 3 and ckpt.options.replication.streams == 2
    with pytest.raises(TypeError, match="keep"):
        CheckpointManager(options=options, keep=4)
    with pytest.raises(TypeError, match="replication"):
        CheckpointManager(options=options, replication="none")


@pytest.mark.parametrize("flat, field, value", [
    ("replication_host", "host", "127.0.0.1"), ("replication_interface", "interface", "lo"),
    ("replication_timeout", "timeout", 7.5), ("replication_streams", "streams", 3),
    ("replication_bandwidth", "bandwidth", "1Gbit"), ("replicas", "replicas", 2),
    ("failure_domain", "failure_domain", "rack-3")])
def test_flat_replication_keywords_still_work_with_a_deprecation_warning(
        store_dir, flat, field, value):
    """The keywords of the last release: each warns, naming its ReplicationOptions field, and
    sets that field as the new spelling does."""
    with pytest.warns(DeprecationWarning, match=rf"{flat}=.*ReplicationOptions\({field}=") as w:
        ckpt = manager(store_dir, **{flat: value})
    assert w[0].filename == __file__  # the warning points at the caller's line
    with ckpt:
        new = Options(job_id="job-config", local_dir=store_dir, replication=ReplicationOptions(
            mode="none", **{field: value})).resolved()
        assert ckpt.options == new
    assert DEPRECATED_KEYWORDS[flat] == field


def test_a_flat_keyword_and_its_field_together_are_refused(store_dir):
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="replication_streams"):
        CheckpointManager(job_id="job-config", local_dir=store_dir, replication_streams=2,
                          replication=ReplicationOptions(mode="none", streams=3))
    with pytest.raises(TypeError, match="unexpected keyword argument 'replication_port'"):
        CheckpointManager(job_id="job-config", local_dir=store_dir, replication_port=1)


# ---------------------------------------------------------------- replication bandwidth and interface

@pytest.mark.parametrize("text, rate", [
    (125000000, 125000000), ("125000000", 125000000), ("100MB/s", 100 * 10**6),
    ("1.5GB/s", 1_500_000_000), ("512MiB/s", 512 << 20), ("100M", 100 << 20),
    ("1Gbit", 125_000_000), ("800Mbit/s", 100_000_000), ("10Gbps", 1_250_000_000),
    (" 2 gbit/s ", 250_000_000), (0, 0), ("0", 0), ("none", 0), ("Unlimited", 0), ("off", 0),
    ("auto", "auto"), ("AUTO", "auto")])
def test_bandwidths_with_units(text, rate):
    assert parse_bandwidth(text, "replication_bandwidth") == rate


@pytest.mark.parametrize("bad", ["fast", "-1", -1, True, "0.5", float("nan"), float("inf"),
                                 "1 Mb/ss", "Gbit", "", "1e9"])
def test_bad_bandwidths_are_refused(bad):
    with pytest.raises(ConfigError, match="not a bandwidth"):
        parse_bandwidth(bad, "replication_bandwidth")


def test_bandwidth_argument_wins_over_its_variable(store_dir, monkeypatch):
    monkeypatch.setenv("MLCHECKPOINT_REPLICATION_BANDWIDTH", "1Gbit")
    assert ReplicationOptions().resolved().bandwidth == 125_000_000
    assert ReplicationOptions(bandwidth="none").resolved().bandwidth == 0
    assert ReplicationOptions(bandwidth="2GB/s").bandwidth == 2 * 10**9


def resolve_and_check(**fields):
    """ReplicationOptions as the manager resolves them, with its check of the listener's
    settings."""
    options = ReplicationOptions(**fields).resolved()
    network.check_listen_settings(options.host, options.interface,
                                  host_given="host" in fields, interface_given="interface" in fields)
    return options


def test_replication_interface_is_checked_and_kept(store_dir, monkeypatch):
    monkeypatch.setenv("MLCHECKPOINT_REPLICATION_IFNAME", "lo")
    assert resolve_and_check().interface == "lo"
    # With a host too: the same address is fine, another one is refused naming both.
    assert resolve_and_check(host="127.0.0.1").host == "127.0.0.1"
    with pytest.raises(ConfigError) as ei:
        resolve_and_check(host="10.0.0.7")
    msg = str(ei.value)
    assert "replication_host='10.0.0.7'" in msg and "MLCHECKPOINT_REPLICATION_IFNAME='lo'" in msg
    monkeypatch.delenv("MLCHECKPOINT_REPLICATION_IFNAME")
    with pytest.raises(ConfigError, match="replication_interface='nosuch0' is not a network "
                                          "interface here .*lo"):
        resolve_and_check(interface="nosuch0")
