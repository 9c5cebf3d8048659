"""The loop of a reinforcement-learning run (the actor-learner strategy, `gradmesh.engine.actor_learner`).

The Trainer's loop draws global batches from a dataset; an actor-learner run has none, so its
engine runs whole and this loop does what the Trainer's services do around it: fault injection
(`--inject kill:rank=R,step=N`: an actor's N-th trajectory, a learner's N-th update), the
learners' checkpoints every `checkpoint.every` updates and the restart from the last one,
metrics.jsonl (a row per `rl.log_every` updates, written by rank 0), progress, and at the end
model.safetensors, summary.json and the summary table.
"""

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gradmesh import env, rundir
from gradmesh.config import Config
from gradmesh.engine.actor_learner import ActorLearnerEngine, Setup
from gradmesh.engine.actor_learner.learner import Episodes
from gradmesh.engine.actor_learner.rounds import Hooks, Round
from gradmesh.fault import checkpoint
from gradmesh.fault.inject import Injector, parse_faults
from gradmesh.files import open_append
from gradmesh.loop.finish import write_results
from gradmesh.loop.session import init
from gradmesh.models.actor_critic import ActorCritic
from gradmesh.monitor.experience import ReturnProgress
from gradmesh.monitor.progress import print_summary
from gradmesh.optim import optimizer_spec
from gradmesh.parallel.registry import mesh_for


@dataclass
class Clock:
    """Rank 0's record of the run so far: when it started, the last row's figures, the target."""

    start: float = field(default_factory=time.perf_counter)
    last_time: float = 0.0
    last_steps: list[int] = field(default_factory=list)
    trained: int = 0
    last_trained: int = 0
    reached_s: float | None = None
    reached_env_steps: int | None = None
    lost: list[int] = field(default_factory=list)
    earlier_env_steps: int = 0
    """Environment steps before the checkpoint this start resumed from (its actors count from 0)."""
    loss: float = float("nan")
    row_step: int = -1
    """The step of the last metrics row (a closing round that trained nothing keeps the step: no second row)."""
    """The loss of the last round that trained (the closing rounds, draining the queues, may train on nothing)."""


def _make_optimizer(cfg: Config):
    kind, kwargs = optimizer_spec(cfg.train)
    return lambda net: kind(net.parameters(), **kwargs)


class ActorLearnerRun:
    def __init__(self, cfg: Config, run_info: dict):
        self.cfg, self.run_info = cfg, run_info
        world = env.placement().world_size
        self.session = init(device="cpu", seed=cfg.train.seed, mesh=mesh_for(cfg.train.strategy, world, cfg.train.mesh))
        torch.set_num_threads(1)  # tiny networks: one thread each is fastest, and leaves the cores to the ranks
        self.run_dir = Path(cfg.run.dir)
        self.rank = self.session.rank
        self.injector = Injector(parse_faults(cfg.fault.inject), self.session.identity, self.run_dir)
        hooks = Hooks(
            before_update=self.injector.before_step,
            before_trajectory=self.injector.before_step,
            after_round=self.after_round,
            lost=self.lost,
            generation=env.restart_count,
        )
        setup = Setup(cfg.rl, cfg.train.max_steps, cfg.train.seed, lambda: ActorCritic(hidden=cfg.model.hidden),
                      _make_optimizer(cfg), hooks)  # fmt: skip
        self.engine = ActorLearnerEngine(self.session.topology, setup)
        self.clock = Clock()
        self.progress = ReturnProgress(cfg.rl.target_return, enabled=self.rank == 0 and not cfg.run.quiet)
        self.checkpointer = None
        if self.engine.is_learner:
            self.checkpointer = checkpoint.Checkpointer(
                self.run_dir, self.engine.learners_group, self.rank == 0, keep=2
            )

    # -- hooks -----------------------------------------------------------------------------------

    def lost(self, rank: int) -> None:
        self.clock.lost.append(rank)
        print(f"gradmesh: actor rank {rank} was lost; the learners go on without it", file=sys.stderr, flush=True)

    def after_round(self, round_: Round) -> None:
        clock = self.clock
        clock.trained += round_.steps
        if round_.steps:
            clock.loss = round_.loss
        if round_.reached and clock.reached_s is None:
            clock.reached_s, clock.reached_env_steps = time.perf_counter() - clock.start, sum(round_.env_steps)
        every = self.cfg.checkpoint.every
        if every and round_.steps and round_.version % every == 0 and not round_.finished:
            self._save(round_)
        due = round_.finished or (round_.steps and round_.version % self.cfg.rl.log_every == 0)
        if self.rank == 0 and due and round_.version != self.clock.row_step:
            self._write_row(round_)

    def _write_row(self, round_: Round) -> None:
        clock, now = self.clock, time.perf_counter() - self.clock.start
        elapsed = max(now - clock.last_time, 1e-9)
        before = clock.last_steps or [0] * len(round_.env_steps)
        per_actor = [(after - was) / elapsed for after, was in zip(round_.env_steps, before)]
        row = {
            "step": round_.version,
            "loss": clock.loss,
            "time": time.time(),
            "samples_per_s": (clock.trained - clock.last_trained) / elapsed,
            "env_steps": clock.earlier_env_steps + sum(round_.env_steps),
            "env_steps_per_s": sum(per_actor),
            "actor_env_steps_per_s": per_actor,
            "episode_return": round_.return_mean,
            "episodes": round_.episodes,
            "staleness_mean": round_.lag_mean,
            "staleness_max": round_.lag_max,
        }
        clock.last_time, clock.last_steps, clock.last_trained = now, list(round_.env_steps), clock.trained
        clock.row_step = round_.version
        with open_append(self.run_dir / "metrics.jsonl") as handle:
            handle.write(json.dumps(row) + "\n")
        self.progress.update(row)

    # -- checkpoints -------------------------------------------------------------------------------

    def _save(self, round_: Round) -> None:
        assert self.checkpointer is not None
        episodes = self.engine.episodes
        state = {
            "step": round_.version,
            "strategy": self.cfg.train.strategy,
            "run": self.run_info,
            "sampler": {},  # no dataset to position: the actors' environments start afresh
            "rl": {
                "returns": list(episodes.returns),
                "episodes": episodes.count,
                "env_steps": self.clock.earlier_env_steps + sum(round_.env_steps),
            },
        }
        self.checkpointer.save(round_.version, self.engine, state)

    def restore(self) -> None:
        """A learner after a restart (or --resume): the newest intact checkpoint, if any."""
        if not (self.cfg.checkpoint.resume or env.restart_count() > 0) or self.checkpointer is None:
            return
        path = checkpoint.latest_good_checkpoint(self.run_dir, warn=lambda text: print(text, file=sys.stderr))
        if path is None:
            return
        state = self.checkpointer.load(path, self.engine)
        learner = self.engine.learner
        assert learner is not None
        learner.version = state["step"]
        self.engine.episodes = Episodes(state["rl"]["returns"], state["rl"]["episodes"])
        self.clock.earlier_env_steps = state["rl"]["env_steps"]
        if self.rank == 0:
            rundir.truncate_steps(self.run_dir / "metrics.jsonl", state["step"])
            self.progress.note(f"resumed from {path} (update {state['step']})")

    # -- the run -----------------------------------------------------------------------------------

    def run(self) -> dict:
        self.restore()
        self.clock.start = time.perf_counter()
        try:
            last = self.engine.run()
        except RuntimeError as error:
            if self.engine.is_learner:
                raise
            # an actor whose learner is gone: the launcher restarts every rank (or ends the run)
            print(f"gradmesh: actor rank {self.rank} lost its learner ({str(error)[:80]}...)", file=sys.stderr)
            raise SystemExit(1) from None
        self.progress.close()
        summary = self._summary(last) if self.rank == 0 and last is not None else {}
        if summary and last is not None:
            weights = {name: value.detach().clone() for name, value in self.engine.net.state_dict().items()}
            write_results(self.run_dir, weights, summary, last.version)
            if not self.cfg.run.quiet:
                print_summary(summary)
        # No session.close(): its barrier over every rank would wait for actors that were lost;
        # the worker leaves without finalisation (gradmesh.worker.main), which is safe here.
        return summary

    def _summary(self, last: Round) -> dict:
        wall = time.perf_counter() - self.clock.start
        ranks = self.engine.ranks
        actors = ranks.actors
        counts = last.counts
        rl = {
            "learners": self.cfg.rl.learners if ranks.world > 1 else 1,
            "actors": len(actors),
            "actor_ranks": actors,
            "env_steps": self.clock.earlier_env_steps + sum(last.env_steps),
            "env_steps_per_s": sum(last.env_steps) / wall,
            "actor_env_steps_per_s": [steps / wall for steps in last.env_steps],
            "episode_return": last.return_mean,
            "episodes": last.episodes,
            "target_return": self.cfg.rl.target_return,
            "target_reached_s": self.clock.reached_s,
            "target_reached_env_steps": self.clock.reached_env_steps,
            "policy_lag": self._lag(),
            "trajectories": counts,
            "lost_actors": [rank for rank, lost in zip(actors, counts["lost"]) if lost],
        }
        return {
            "strategy": self.cfg.train.strategy,
            "world_size": ranks.world,
            "steps": last.version,
            "samples": self.clock.trained,
            "wall_s": wall,
            "samples_per_s": self.clock.trained / wall,
            "final_loss": self.clock.loss,
            "staleness": rl["policy_lag"],
            "rl": rl,
            "run_dir": str(self.run_dir),
        }

    def _lag(self) -> dict:
        rows = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines() if line]
        lags = [row for row in rows if row.get("staleness_mean") is not None]
        if not lags:
            return {"max": 0, "mean": 0.0}
        return {
            "max": max(row["staleness_max"] for row in lags),
            "mean": sum(r["staleness_mean"] for r in lags) / len(lags),
        }


def train_actor_learner(cfg: Config, run_info: dict) -> dict:
    """This rank's part of a reinforcement-learning run; the summary on rank 0 ({} elsewhere)."""
    return ActorLearnerRun(cfg, run_info).run()
