"""Randomized fault test: nodes killed and wiped at random points, invariants after every restart.

A simulated cluster (one torchrun agent and tmpfs dir per node) runs tests/workers/chaos_job.py
round after round. Each round starts the whole job, which resumes and then saves (save or
async_save, sometimes waiting for replication); the test then kills one node at a random
moment: by a crash point (MLCHECKPOINT_CRASH_AT: mid-save, mid-commit, mid-replication, or
during the resume's fetches), or by an external SIGKILL at a random delay after the launch,
after the resume began, or after a random step. The survivors are killed too (the whole job
restarts, as under torchrun), and sometimes the dead node's memory is wiped (a replacement
machine). At most one node per pair is lost at a time: a pair with a wiped node gets no
second wipe of the other node until a step is acknowledged again.

After every restart, from the ranks' reports:
- the bytes loaded are exactly those saved at the reported step (every tensor torch.equal,
  every non-tensor value equal), of one incarnation that really saved that step;
- all ranks report the same step and incarnation;
- the step is never older than the newest acknowledged one (a step for which
  ``wait_replicated`` returned True), and when equal, it is that very incarnation;
- the step is never older than the newest step some node that was not wiped held whole
  (metadata and every rank's shard) when the round's job was killed. That is the oracle of
  the mode without ``wait_replicated`` (``test_chaos_back_to_back_without_acks``: 2 x 2 ranks
  saving back to back, so replication skips steps), and it holds in every mode.

The worker's state is a pure function of (step, incarnation): a job that rolls back saves the
same step numbers again with other bytes, so mixing two runs' copies of a step is caught.

CI runs a few rounds with a fixed seed. Longer runs, by hand:

    MLCHECKPOINT_CHAOS_ROUNDS=200 python -m pytest -s tests/jobs/test_chaos.py
    MLCHECKPOINT_CHAOS_SEED=7 MLCHECKPOINT_CHAOS_ROUNDS=50 python -m pytest -s tests/jobs/test_chaos.py

Every failure names the seed and the round, the plan of every round so far and the node logs.
``-s`` shows the summary (kills survived, resumes by source).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from cluster import Cluster, _dead, kill_strays, lose_node

from mlcheckpoint.store import LocalStore

SEED = int(os.environ.get("MLCHECKPOINT_CHAOS_SEED", "373"))
ROUNDS = int(os.environ.get("MLCHECKPOINT_CHAOS_ROUNDS", "6"))
HANG_S = 120  # a launch making no progress for this long is reported as hung

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300 + 60 * ROUNDS)]

# (crash point, when): "save" points fire at a step saved after the resume, "resume" points
# are armed from the start (the first replica received: the resume's or healing fetches).
CRASH_POINTS = [("before_data", "save"), ("mid_data", "save"), ("before_manifest", "save"),
                ("mid_commit", "save"), ("before_metadata", "save"), ("replica_mid_send", "save"),
                ("replica_mid_recv", "save"), ("replica_mid_recv", "resume")]
HOW = {"crash": 0.3, "at_step": 0.2, "at_ack": 0.15, "at_resume": 0.15, "at_launch": 0.1,
       "none": 0.1}


@dataclass
class Plan:
    """What one round does to the job."""

    how: str  # crash | at_step | at_ack | at_resume | at_launch | none (exits 0 after its budget)
    victim: int
    steps: int  # the job's step budget
    crash_at: str | None = None  # CHAOS_CRASH_AT for the victim
    target: int = 0  # at_step / crash: the victim's k-th save after its resume
    delay: float = 0.0  # seconds after the trigger before the victim is killed
    survivor_delay: float = 0.0  # seconds the survivors live on after the victim died
    wipe: list[int] = field(default_factory=list)  # nodes whose memory is lost after the round


@dataclass
class Event:
    round: int
    kind: str
    step: int
    at: float  # time.time() when the worker wrote it


def read_events(path: str) -> list[Event]:
    """One rank's progress file (tests/workers/chaos_job.py); a torn last line is ignored."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    events = []
    for line in text.split("\n")[:-1]:
        rnd, kind, step, at = line.split()
        events.append(Event(int(rnd), kind, int(step), float(at)))
    return events


class ChaosFailure(AssertionError):
    """An invariant broke (or the job misbehaved); the message says how to reproduce it."""


class Chaos:
    """Drives the rounds on one cluster and checks the invariants after every restart."""

    def __init__(self, c: Cluster, seed: int, test: str, env_rounds=lambda rnd: rnd,
                 ack: float = 0.6):
        self.c, self.seed, self.test = c, seed, test
        self.env_rounds = env_rounds  # the MLCHECKPOINT_CHAOS_ROUNDS that runs ``rnd`` rounds
        self.ack = ack  # how often a save waits for replication
        self.whole_floor: int | None = None  # newest step a surviving node held whole
        self.rng = random.Random(f"{seed}/{c.nnodes}")
        self.plans: list[str] = []
        self.lost: dict[int, tuple[int, int]] = {}  # pair -> (wiped node, round of the wipe)
        self.stats: Counter = Counter()
        self.unchecked_kills = 0  # kills since the last restart whose invariants were checked

    # ------------------------------------------------------------------ ledger
    def events(self, rank: int) -> list[Event]:
        return read_events(os.path.join(self.c.out_dir, f"chaos-progress.rank{rank}.txt"))

    def all_events(self) -> list[Event]:
        return [e for r in range(self.c.nnodes * self.c.nproc) for e in self.events(r)]

    def saved_before(self, rnd: int) -> set[tuple[int, int]]:
        """(step, incarnation) pairs some rank began to save before round ``rnd``."""
        return {(e.step, e.round) for e in self.all_events() if e.kind == "save" and e.round < rnd}

    def newest_ack(self, before: int) -> tuple[int, int] | None:
        """(step, incarnation) of the newest step acknowledged before round ``before``."""
        acks = [(e.step, e.round) for e in self.all_events() if e.kind == "ack" and e.round < before]
        return max(acks, default=None)

    # ------------------------------------------------------------------ failing
    def fail(self, rnd: int, what: str) -> None:
        history = "\n".join(self.plans)
        raise ChaosFailure(
            f"chaos seed={self.seed} round={rnd}: {what}\n"
            f"reproduce (timing permitting): MLCHECKPOINT_CHAOS_SEED={self.seed} "
            f"MLCHECKPOINT_CHAOS_ROUNDS={self.env_rounds(rnd + 1)} "
            f"python -m pytest -s tests/jobs/test_chaos.py -k {self.test}\nrounds:\n{history}\n"
            f"progress: {[(e.round, e.kind, e.step) for e in self.all_events()][-60:]}\n"
            f"logs:\n{self.c.logs()}")

    # ------------------------------------------------------------------ planning
    def plan(self, rnd: int, final: bool) -> Plan:
        rng, nnodes = self.rng, self.c.nnodes
        if final:
            return Plan("none", 0, steps=1)
        how = rng.choices(list(HOW), weights=list(HOW.values()))[0]
        victim = rng.randrange(nnodes)
        p = Plan(how, victim, steps=3 if how == "none" else 40,
                 target=rng.randint(1, 5), survivor_delay=rng.uniform(0, 0.5))
        if how == "crash":
            point, when = rng.choice(CRASH_POINTS)
            if point == "before_metadata":
                p.victim = 0  # only the coordinator writes the global metadata
            p.crash_at = point if when == "resume" else f"{point}@+{p.target}"
        elif how == "at_step":
            p.delay = rng.uniform(0, 0.3)
        elif how == "at_ack":  # right after a step was acknowledged: is it really on two nodes?
            p.delay, p.survivor_delay = rng.uniform(0, 0.02), rng.uniform(0, 0.05)
        elif how == "at_resume":  # a resume takes ~0.05 s, or ~0.2 s when it fetches
            p.delay = rng.uniform(0, 0.3)
        elif how == "at_launch":  # while starting: imports, rendezvous, connecting peers
            p.delay = rng.uniform(0, 4)
        if rng.random() < 0.45:
            p.wipe.append(p.victim)
        if nnodes >= 4 and rng.random() < 0.3:  # now and then a node of another pair as well
            other = rng.choice([k for k in range(nnodes) if k // 2 != p.victim // 2])
            p.wipe.append(other)
        return p

    def allowed_wipes(self, rnd: int, wanted: list[int]) -> list[int]:
        """The wipes that keep every pair with at most one lost node: a pair is whole again
        once a step is acknowledged after its wipe (that step is then on two nodes)."""
        acked_rounds = {e.round for e in self.all_events() if e.kind == "ack"}
        for pair, (_, wiped_in) in list(self.lost.items()):
            if any(r > wiped_in for r in acked_rounds):
                del self.lost[pair]
        allowed = []
        for k in wanted:
            node, _ = self.lost.get(k // 2, (k, rnd))
            if node == k:
                allowed.append(k)
                self.lost[k // 2] = (k, rnd)
        return allowed

    # ------------------------------------------------------------------ one round
    def run_round(self, rnd: int, final: bool = False) -> None:
        p = self.plan(rnd, final)
        floor = self.newest_ack(rnd)
        saved = self.saved_before(rnd)
        self.plans.append(f"  round {rnd}: {p} (floor: newest acknowledged (step, inc) {floor}, "
                          f"newest whole on a survivor {self.whole_floor})")
        cfg = {"round": rnd, "steps": p.steps, "seed": self.seed, "async": 0.5, "ack": self.ack,
               "ack_timeout": 10, "compute": 0.05 if self.ack else 0.0}
        env = {"CHAOS_CRASH_NODE": str(p.victim), "CHAOS_CRASH_AT": p.crash_at or ""}
        t0 = time.monotonic()
        self.c.start("chaos_job.py", json.dumps(cfg), env=env)
        try:
            self.inject(rnd, p)
        finally:
            self.c.kill_all()
            kill_strays(self.c)
        self.plans[-1] += f" [{time.monotonic() - t0:.1f}s]"
        self.check_resume(rnd, floor, saved, every_rank=p.how == "none")
        wiped = self.allowed_wipes(rnd, p.wipe)
        self.whole_floor = self.newest_whole(rnd, survivors=[k for k in range(self.c.nnodes)
                                                             if k not in wiped])
        for k in wiped:
            self.c.nodes[k].wipe()
        self.stats["wipes"] += len(wiped)
        self.stats["wipes skipped (the pair had lost a node)"] += len(p.wipe) - len(wiped)
        self.plans[-1] += f" wiped {wiped}"

    def inject(self, rnd: int, p: Plan) -> None:
        """Run the round's launch and kill its victim as planned (or let it finish)."""
        if p.how == "none":
            codes = self.wait_all(rnd)
            if codes != [0] * self.c.nnodes:
                self.fail(rnd, f"a launch without faults exited with {codes}")
            return
        outcome = "triggered"
        if p.how == "crash":
            outcome = self.wait_for(rnd, p, lambda: self.saves(rnd, p.victim) >= p.target + 3)
            self.stats["crash points fired" if outcome == "victim died" else "crash points missed"] += 1
        elif p.how == "at_launch":
            until = time.monotonic() + p.delay
            outcome = self.wait_for(rnd, p, lambda: time.monotonic() >= until)
        elif p.how == "at_resume":
            outcome = self.wait_for(rnd, p, lambda: any(e.round == rnd and e.kind == "resume"
                                                        for e in self.events(p.victim)))
            time.sleep(p.delay)
        elif p.how == "at_step":
            outcome = self.wait_for(rnd, p, lambda: self.saves(rnd, p.victim) >= p.target)
            time.sleep(p.delay)
        elif p.how == "at_ack":
            outcome = self.wait_for(rnd, p, lambda: any(e.round == rnd and e.kind == "ack"
                                                        for e in self.events(p.victim)))
            time.sleep(p.delay)
        if outcome == "finished":
            return
        lose_node(self.c.nodes[p.victim])  # no-op when a crash point killed it already
        self.stats["kills"] += 1
        self.unchecked_kills += 1
        time.sleep(p.survivor_delay)  # the survivors notice, or go on a little

    def newest_whole(self, rnd: int, survivors: list[int]) -> int | None:
        """The newest step one of ``survivors`` holds whole now (the job is dead), if every
        rank finished its resume this round: the resume settled every node then, so all they
        hold is of the job's history (a node killed before that may still hold steps of a run
        the job abandoned, which the next resume rightly skips)."""
        ranks = range(self.c.nnodes * self.c.nproc)
        if not all(any(e.round == rnd and e.kind == "resumed" for e in self.events(r))
                   for r in ranks):
            return None
        whole = []
        for k in survivors:
            store = LocalStore(self.c.nodes[k].local_dir, self.c.job_id, create=False)
            try:
                whole += store.inventory.complete_steps()
            finally:
                store.close()
        return max(whole, default=None)

    def saves(self, rnd: int, rank: int) -> int:
        """Saves the rank began in this round."""
        return sum(1 for e in self.events(rank) if e.round == rnd and e.kind == "save")

    def victim_died(self, rnd: int, victim: int) -> bool:
        """Has the victim's rank process died (its agent may not have noticed yet)?"""
        pids = [e.step for e in self.events(victim) if e.round == rnd and e.kind == "pid"]
        return bool(pids) and _dead(pids[-1]) or self.c.nodes[victim].proc.poll() is not None

    def wait_for(self, rnd: int, p: Plan, trigger) -> str:
        """Poll until ``trigger()``; fail if a node dies before any fault was injected (a
        crash point's victim may, and then the others may follow)."""
        deadline = time.monotonic() + HANG_S
        while True:
            if p.how == "crash" and self.victim_died(rnd, p.victim):
                return "victim died"
            if trigger():
                return "triggered"
            codes = {n.rank: n.proc.poll() for n in self.c.nodes}
            if all(code == 0 for code in codes.values()):
                return "finished"
            dead = {k: code for k, code in codes.items() if code not in (None, 0)}
            if dead:
                self.fail(rnd, f"nodes {dead} exited before any fault was injected")
            if time.monotonic() > deadline:
                self.fail(rnd, f"no progress in {HANG_S} s")
            time.sleep(0.02)

    def wait_all(self, rnd: int) -> list[int]:
        try:
            return self.c.wait(HANG_S)
        except AssertionError:
            self.fail(rnd, f"launch did not finish in {HANG_S} s")

    # ------------------------------------------------------------------ invariants
    def check_resume(self, rnd: int, floor: tuple[int, int] | None,
                     saved: set[tuple[int, int]], every_rank: bool) -> None:
        whole_floor = self.whole_floor
        """The invariants, on what the ranks that got that far reported about their resume
        (``every_rank``: the launch was not killed, so every rank must have reported)."""
        reports = self.c.results(f"chaos-r{rnd}")
        if every_rank and sorted(reports) != list(range(self.c.nnodes * self.c.nproc)):
            self.fail(rnd, f"only ranks {sorted(reports)} reported a resume")
        if not reports:
            self.stats["killed before any resume report"] += 1
            return
        for rank, r in sorted(reports.items()):
            if not r["match"]:
                self.fail(rnd, f"rank {rank} loaded bytes that are not step {r['step']} "
                               f"incarnation {r['inc']}: {r['mismatch'][:10]}; report {r}")
            if r["step"] is not None and (r["step"], r["inc"]) not in saved:
                self.fail(rnd, f"rank {rank} resumed (step, inc) {(r['step'], r['inc'])}, which "
                               f"no earlier round saved; report {r}")
            if floor is not None:
                step = -1 if r["step"] is None else r["step"]
                if step < floor[0]:
                    self.fail(rnd, f"rank {rank} resumed step {r['step']}, older than the newest "
                                   f"acknowledged step {floor[0]} (incarnation {floor[1]}); "
                                   f"report {r}")
                if step == floor[0] and r["inc"] != floor[1]:
                    self.fail(rnd, f"rank {rank} resumed step {step} of incarnation {r['inc']}, "
                                   f"but incarnation {floor[1]} of it was acknowledged; report {r}")
            if whole_floor is not None and (r["step"] is None or r["step"] < whole_floor):
                self.fail(rnd, f"rank {rank} resumed step {r['step']}, older than step "
                               f"{whole_floor}, which a node that was not wiped held whole when "
                               f"the last job died; report {r}")
        verdicts = {rank: (r["step"], r["inc"], r.get("shared_digest")) for rank, r in reports.items()}
        if len(set(verdicts.values())) != 1:
            self.fail(rnd, f"ranks disagree on (step, incarnation, shared digest): {verdicts}")
        first = reports[min(reports)]
        self.stats[f"resumes from {first['source']}"] += 1
        self.stats["checked restarts"] += 1
        self.stats["kills survived"] += self.unchecked_kills
        self.unchecked_kills = 0
        self.plans[-1] += f" -> resumed {(first['step'], first['inc'])} from {first['source']}"

    def summary(self) -> str:
        events = Counter(e.kind for e in self.all_events())
        incarnations = Counter(step for step, _ in self.saved_before(len(self.plans)))
        self.stats["steps saved"] = events["saved"]
        self.stats["step numbers saved by several incarnations"] = \
            sum(1 for n in incarnations.values() if n > 1)
        self.stats["waits acknowledged"] = events["ack"]
        self.stats["waits timed out"] = events["noack"]
        return (f"chaos seed={self.seed} nodes={self.c.nnodes}: "
                + ", ".join(f"{k}: {v}" for k, v in sorted(self.stats.items())))


def run_chaos(nnodes: int, rounds: int, test: str, env_rounds=lambda rnd: rnd, *,
              nproc: int = 1, ack: float = 0.6) -> None:
    with Cluster(nnodes, nproc=nproc) as c:
        chaos = Chaos(c, SEED, test, env_rounds, ack)
        for rnd in range(rounds + 1):
            try:  # the last round injects nothing: the job must come back clean after it all
                chaos.run_round(rnd, final=rnd == rounds)
            except ChaosFailure:
                raise
            except Exception as e:  # noqa: BLE001  (any failure, e.g. a node that survived SIGKILL, must name seed and round)
                chaos.fail(rnd, f"{type(e).__name__}: {e}")
        print(chaos.summary())
        print("\n".join(chaos.plans))


def test_chaos_two_nodes():
    """Random kills and wipes on 2 nodes, rounds with a fixed seed: every restart resumes a
    step no older than the newest acknowledged one, bit-exact and agreed by all ranks."""
    run_chaos(2, ROUNDS, "test_chaos_two_nodes")


def test_chaos_four_nodes():
    """The chaos rounds on 4 nodes (two pairs), so losses in one pair meet saves and reads of
    the other: the same invariants after every restart."""
    run_chaos(4, ROUNDS // 4, "test_chaos_four_nodes", env_rounds=lambda rnd: 4 * rnd)


def test_chaos_back_to_back_without_acks():
    """2 nodes x 2 ranks saving back to back, never waiting for replication: replication skips
    steps, ranks must still replicate the same ones, and the floor is what a survivor held
    whole at the kill."""
    run_chaos(2, max(1, ROUNDS * 2 // 3), "test_chaos_back_to_back_without_acks",
              env_rounds=lambda rnd: (rnd * 3 + 1) // 2, nproc=2, ack=0.0)
