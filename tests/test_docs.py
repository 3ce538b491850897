"""The docs match the code (issue 32): the README's "Use it" program is examples/quickstart.py,
verbatim, and runs as written; every path of a job directory that README.md or docs/*.md
gives is one that ``store/layout.py`` (the one home of file names) makes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from cluster import free_port

from mlcheckpoint.store.layout import (
    BANDWIDTH,
    CLAIM,
    CLAIM_LOCK,
    FINISHED,
    HISTORY,
    LOCK,
    LOCKS,
    ORPHANS,
    POOL,
    RETENTION_LOCK,
    STEPS,
    Kind,
    classify,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "examples", "quickstart.py")
DOCS = [os.path.join(REPO, "README.md")] + sorted(
    os.path.join(REPO, "docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
    if name.endswith(".md"))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


# ---------------------------------------------------------------- the README's program

def readme_program() -> str:
    """The first python block of the README's "Use it" section."""
    section = _read(DOCS[0]).split("\n## Use it\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```\n", 1)[0]


def test_the_readme_program_is_examples_quickstart():
    assert readme_program() == _read(QUICKSTART), (
        "README.md's 'Use it' block must be examples/quickstart.py, verbatim")


def _launch(workdir: str, env: dict[str, str]) -> str:
    """The README's command, in ``workdir``: its output."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           QUICKSTART], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def _saved_steps(local_dir: str) -> list[int]:
    out = subprocess.run([sys.executable, "-m", "mlcheckpoint.cli", "history", "--job", "quickstart",
                          "--local-dir", local_dir, "--json"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return sorted(e["step"] for e in json.loads(out) if e["event"] == "save" and e["rank"] == 0)


@pytest.mark.slow
def test_the_readme_program_runs_and_resumes_at_the_next_step(store_dir):
    """As written, with ``torchrun --nproc-per-node=2``: a fresh start saves steps 0..19 (10
    and 20 of them persistent); run again it resumes step 19 from memory and has nothing left
    to do; with memory and the newest persistent step gone it resumes step 9 from the
    persistent folder, saves 10..19 again and trains them exactly as the first run did."""
    local = os.path.join(store_dir, "shm")
    # torchrun's rendezvous port from its environment (PET_MASTER_PORT), the command as
    # written: its default, 29500, may be another test run's on this machine.
    env = dict(os.environ, MLCHECKPOINT_JOB_ID="quickstart", MLCHECKPOINT_LOCAL_DIR=local,
               OMP_NUM_THREADS="1", PET_MASTER_PORT=str(free_port()))
    first = _launch(store_dir, env)
    assert "resumed: step None from None" in first
    losses = dict(re.findall(r"^step (\d+) loss (\S+)$", first, re.MULTILINE))
    assert sorted(map(int, losses)) == list(range(20)), first
    assert _saved_steps(local) == list(range(20))
    folder = os.path.join(store_dir, "checkpoints")
    assert sorted(os.listdir(folder)) == ["step-000000000009", "step-000000000019"]

    assert "resumed: step 19 from local" in _launch(store_dir, env)
    assert _saved_steps(local) == list(range(20))  # nothing saved again

    shutil.rmtree(local)
    shutil.rmtree(os.path.join(folder, "step-000000000019"))
    again = _launch(store_dir, env)
    assert "resumed: step 9 from persistent" in again
    assert _saved_steps(local) == list(range(10, 20))
    resumed = dict(re.findall(r"^step (\d+) loss (\S+)$", again, re.MULTILINE))
    assert resumed == {step: loss for step, loss in losses.items() if int(step) >= 10}


# ---------------------------------------------------------------- paths in the docs

# A path of a job directory in the docs: it names the job directory (``<job>``, ``<job_id>``,
# ``<job_dir>``) or starts inside it.
_PATH = re.compile(r"[\w./<>:$-]*(?:<job(?:_id|_dir)?>|\b(?:steps|pool|orphans|locks)/|"
                   r"history\.jsonl|rank-[<\d])[\w./<>:*-]*")
_JOB = re.compile(r"^.*?<job(?:_id|_dir)?>(?:/|$)")
# Placeholders, as layout.py formats them; a bare <step> or <r> stands for an unpadded number.
_PLACEHOLDERS = {"<step:012d>": "000000000031", "<step>": "31", "<r:05d>": "00000", "<r>": "0",
                 "<rank>": "0", "<nn>": "07", "<local_rank:05d>": "00001"}
_TOKENS = {ORPHANS: "0123abcd", POOL: "0123456789abcdef"}  # <token>: its length per folder
_INSIDE = {STEPS: {Kind.STEP}, ORPHANS: {Kind.ORPHAN}, POOL: {Kind.POOL_BUFFER, Kind.POOL_INFLIGHT},
           LOCKS: {Kind.LOCK}}
_IN_STEP = {Kind.DATA, Kind.MANIFEST, Kind.METADATA, Kind.INFLIGHT, Kind.TEMP}
_TOP = {STEPS, POOL, ORPHANS, LOCKS, HISTORY, LOCK, RETENTION_LOCK, CLAIM_LOCK, CLAIM, FINISHED}


def layout_error(path: str) -> str | None:
    """Why ``path`` (inside a job directory, placeholders allowed) is not one layout.py makes;
    None when it is."""
    if _JOB.match(path):
        rel = _JOB.sub("", path)
    else:  # a path written out (/mnt/ckpt/myjob/steps/...): from the job directory's entry on
        inside = re.search(r"(?:^|/)((?:steps|pool|orphans|locks)/.*|history\.jsonl)$", path)
        rel = inside.group(1) if inside else path
    rel = rel.strip("/")
    if not rel:
        return None  # the job directory itself
    parts = rel.split("/")
    if parts[0] not in _TOP:
        return f"{parts[0]!r} is not an entry of a job directory"
    for i, part in enumerate(parts[1:], 1):
        if "*" in part:
            continue  # a glob stands for several names
        name = part.replace("<token>", _TOKENS.get(parts[0], ""))
        for placeholder, value in _PLACEHOLDERS.items():
            name = name.replace(placeholder, value)
        kind = classify(name).kind
        allowed = _INSIDE.get(parts[0], set()) if i == 1 else _IN_STEP if parts[0] == STEPS else set()
        if parts[0] == LOCKS and name == BANDWIDTH:
            continue
        if kind not in allowed:
            return (f"{part!r} (as {name!r}) is not a name layout.py makes in {parts[0]}/ "
                    f"(it reads as: {kind.value})")
    return None


def doc_paths() -> list[tuple[str, int, str]]:
    """(doc, line, path) of every job-directory path README.md and docs/*.md give."""
    found = []
    for doc in DOCS:
        for n, line in enumerate(_read(doc).splitlines(), 1):
            for m in _PATH.finditer(line):
                path = m.group(0).rstrip(".,:")
                if "://" in path or path.endswith(".py"):
                    continue  # a checkpoint id (mlcheckpoint://<job>/<step>) or a module
                found.append((os.path.relpath(doc, REPO), n, path))
    return found


def test_the_checker_knows_the_layout_and_its_mistakes():
    layout = _read(os.path.join(REPO, "mlcheckpoint", "store", "layout.py")).split('"""')[1]
    canonical = re.findall(r"^ {8}(\S+)", layout, re.MULTILINE)  # the docstring's table
    assert len(canonical) >= 10 and [p for p in canonical if layout_error(p)] == []
    for wrong in ("<local_dir>/<job_id>/steps/<step>/rank-<r>.data", "/mnt/ckpt/<job>/<step>/rank-0.data",
                  "<job>/steps/000000000031/rank-0.data", "<job>/step/000000000031/metadata"):
        assert layout_error(wrong) is not None, wrong


def test_every_job_directory_path_in_the_docs_is_one_layout_makes():
    paths = doc_paths()
    assert any("rank-" in p for _, _, p in paths)  # the checker sees the docs' paths
    wrong = [f"{doc}:{line}: {path}: {why}" for doc, line, path in paths
             if (why := layout_error(path)) is not None]
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------- tests/README.md

def test_the_tests_readme_names_every_top_level_test_file_and_what_it_mirrors():
    """tests/README.md's table lists exactly the test files at the top of tests/, and every
    module or package of mlcheckpoint a row names exists."""
    table = [line for line in _read(os.path.join(REPO, "tests", "README.md")).splitlines()
             if line.startswith("| `test_")]
    listed = {re.match(r"\| `(test_\w+\.py)`", line).group(1) for line in table}
    on_disk = {name for name in os.listdir(os.path.join(REPO, "tests"))
               if name.startswith("test_") and name.endswith(".py")}
    assert listed == on_disk
    package = os.path.join(REPO, "mlcheckpoint")
    for line in table:
        why = line.split("|")[2]
        for name in re.findall(r"`([\w/]+(?:\.py|/))`", why):
            assert any(os.path.exists(os.path.join(root, name.rstrip("/")))
                       for root in (package, os.path.join(REPO, "tests"), REPO)), (name, line)
