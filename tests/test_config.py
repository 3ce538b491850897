"""Job id and local directory resolution (mlcheckpoint.config) and its use by LocalStore."""

from __future__ import annotations

import os

import pytest

from mlcheckpoint import ConfigError, LocalStore
from mlcheckpoint.config import (DEFAULT_LOCAL_DIR, resolve_job_id, resolve_local_dir,
                                 validate_job_id)


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
