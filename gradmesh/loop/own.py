"""Your own training loop on gradmesh: `gradmesh.Loop`, beside the Trainer (which owns the loop).

    gm = gradmesh.Loop(strategy="ddp", run_dir="runs/mine", seed=0)
    model, optimizer = gm.prepare(model, optimizer)
    for step, batch in gm.batches(dataset, global_batch_size=64, steps=1000):
        loss = loss_fn(model(batch[0]), batch[1])      # the mean over this micro-batch
        gm.backward(loss)
        gm.step(optimizer)
        gm.log(accuracy=...)
    gm.close()

The same machinery as the Trainer's, turned inside out: `batches` draws each global batch from
the global-order sampler, hands this rank its share in `grad_accum` micro-batches (gradient
synchronisation only on the last) and, between steps, hands the step to the services —
metrics.jsonl, the step breakdown, stragglers, checkpoints, the dashboard. `backward` weights
the micro-batch's mean loss by its samples' share of the global batch, so N ranks train the
model one process trains, also when an epoch's last batch leaves a rank fewer samples or none
(it then runs one sample at weight 0: every rank joins every collective). `step` is the
engine's own end of a step: the non-finite check, the global clip, the optimizer, zero_grad.
"""

import dataclasses
import inspect
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import torch
import torch.nn as nn

from gradmesh import env
from gradmesh.config import CheckpointConfig, FaultConfig, MonitorConfig, TrainConfig
from gradmesh.data import GlobalBatch, fetch
from gradmesh.engine import ENGINES, StepOutcome
from gradmesh.engine.base import to_device
from gradmesh.engine.collective import CollectiveEngine
from gradmesh.errors import UsageError
from gradmesh.loop.nonfinite import RollBack
from gradmesh.loop.session import init
from gradmesh.loop.trainer import Trainer
from gradmesh.parallel import batchnorm
from gradmesh.parallel.registry import STRATEGIES, load, mesh_for, resolve

OWN_ROWS = tuple(
    name
    for name, row in STRATEGIES.items()
    if issubclass(cast(type, load(ENGINES[row.engine])), CollectiveEngine) and not row.every_share
)
"""The strategies an own loop runs: those whose ranks all run the same forward and backward."""


@dataclasses.dataclass
class _Micro:
    """The micro-batch the user's loop holds now."""

    indices: list[int]
    weight: float
    """Per sample (the engine's: data-parallel degree / samples in the global batch); 0 pads."""
    last: bool
    given: float = 0.0
    """perf_counter when `batches` handed it over (its forward starts there)."""


class Loop:
    """A training loop you write, run on gradmesh's strategies (see the module docstring).

    Under `gradmesh run`, torchrun or plain python (one process). `lr_schedule(step)` (0-based)
    multiplies each parameter group's learning rate; without it the rates stay as built.
    """

    def __init__(
        self, strategy: str | None = None, run_dir: str | Path | None = None, seed: int = 0, *,
        grad_accum: int = 1, grad_clip: float = 0.0, compression: str = "none", bucket_mb: float = 25.0,
        mesh: str = "", checkpoint_every: int = 0, resume: bool = False, log_every: int = 10, quiet: bool = False,
        lr_schedule: Callable[[int], float] | None = None, eval_fn: Callable[[nn.Module], dict] | None = None,
        on_nonfinite: str = "stop", device: str = "auto",
    ):  # fmt: skip
        base = TrainConfig() if strategy is None else TrainConfig(strategy=strategy)
        self.train = dataclasses.replace(
            base, seed=seed, grad_accum=grad_accum, grad_clip=grad_clip, compression=compression,
            bucket_mb=bucket_mb, mesh=mesh, log_every=log_every, warmup_steps=0,
        )  # fmt: skip
        if self.train.strategy not in OWN_ROWS:
            raise UsageError(
                f"gradmesh.Loop runs strategy {self.train.strategy!r} only through gradmesh.Trainer "
                f"(its ranks do not all run your forward); the own loop takes {', '.join(OWN_ROWS)}"
            )
        self.checkpointing = CheckpointConfig(every=checkpoint_every, resume=resume)
        self.faults = FaultConfig(on_nonfinite=on_nonfinite)
        self.run_dir, self.quiet, self.eval_fn, self.lr_schedule = run_dir, quiet, eval_fn, lr_schedule
        world = env.placement().world_size
        self.session = init(device=device, mesh=mesh_for(self.train.strategy, world, mesh), seed=seed)
        resolve(self.train.strategy, self.session.topology.mesh_shape)  # a bad mesh fails here
        self.trainer: Trainer | None = None
        self.micro: _Micro | None = None
        self.outcome: StepOutcome | None = None
        self.save_requested = False
        self.extra: dict = {}
        self.start_step, self.started, self.step_reached = 0, 0.0, 0

    # -- before the loop -----------------------------------------------------------------------

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model with the strategy applied, and the strategy's optimizer built like yours (its
        class, settings and parameter groups): use the two returned, not the ones given."""
        if self.trainer is not None:
            raise UsageError("Loop.prepare takes one model and optimizer, once")
        names = {id(param): name for name, param in model.named_parameters()}
        groups = [
            ([names[id(p)] for p in group["params"]], {k: v for k, v in group.items() if k != "params"})
            for group in optimizer.param_groups
        ]
        if sum(len(n) for n, _ in groups) != len(names):
            raise UsageError("Loop.prepare needs an optimizer over every parameter of the model it is given")
        self.trainer = Trainer(
            self.session, model, _no_loss, None, train=self.train, checkpointing=self.checkpointing,
            optimizer=_spec(optimizer), run_dir=self.run_dir, eval_fn=self.eval_fn,
            quiet=self.quiet, monitor=MonitorConfig(), groups=groups, faults=self.faults,
        )  # fmt: skip
        optimizer = self._engine(self.trainer).optimizer
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        return self.trainer.model, optimizer

    def resume(self) -> None:
        """Go on from the run directory's latest checkpoint (as `resume=True`); before `batches`."""
        self.checkpointing = dataclasses.replace(self.checkpointing, resume=True)

    # -- the loop ------------------------------------------------------------------------------

    def batches(self, dataset, global_batch_size: int, steps: int) -> Iterator[tuple[int, object]]:
        """(step, micro-batch) pairs: this rank's share of each global batch, `grad_accum` pieces a
        step, on this rank's device, from the step a resumed run reached to `steps`."""
        trainer = self._prepared("batches")
        trainer.checkpointing = self.checkpointing
        trainer.run_info = {"global_batch_size": global_batch_size, "seed": self.train.seed}  # a resume must match
        trainer.attach(dataset, dataclasses.replace(self.train, global_batch_size=global_batch_size, max_steps=steps))
        self.start_step = self.step_reached = step = trainer.begin()
        self.started = time.perf_counter()
        while step < steps:
            step += 1
            for service in trainer.services.all:
                service.before_step(step)
            self.tic = time.perf_counter()
            yield from self._micro_batches(trainer, trainer.sampler.next_global(), step)
            step = self.step_reached = self._after_step(trainer, step)

    def _micro_batches(self, trainer: Trainer, batch: GlobalBatch, step: int):
        engine = self._engine(trainer)
        self._set_lr(batch.step)
        self.batch, self.outcome = batch, None
        self.loss_sum, self.counted, self.used = torch.zeros((), device=self.session.device), 0, cast(list[int], [])
        runs, _ = engine.runs(batch)
        for i, (indices, weight) in enumerate(runs):
            with trainer.probe.clock.phase("data"):
                data = to_device(fetch(trainer.engine.job.dataset, indices), self.session.device)
            self.micro = _Micro(indices, weight, i == len(runs) - 1, time.perf_counter())
            # a padding micro-batch (weight 0) takes no part in synchronised batch statistics
            with engine.sync(last_micro_batch=self.micro.last), batchnorm.counting(engine.norms, weight > 0):
                yield step, data
            if self.micro is not None:
                raise UsageError(f"step {step}: call gm.backward(loss) once for every batch gm.batches gives")
        if self.outcome is None:
            raise UsageError(f"step {step}: call gm.step(optimizer) after gm.backward(loss)")

    def _after_step(self, trainer: Trainer, step: int) -> int:
        elapsed, outcome = time.perf_counter() - self.tic, self.outcome
        assert outcome is not None  # _micro_batches checked
        outcome.row.update(self.extra)
        self.extra = {}
        try:
            for service in trainer.services.all:
                service.after_step(outcome, elapsed)
        except RollBack:
            return trainer.roll_back()
        if self.save_requested and not trainer.services.checkpointing.wants_all_ranks(step):
            trainer.services.checkpointing.save(step)
        self.save_requested = False
        return step

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this micro-batch's mean loss, weighted by its share of the global batch."""
        micro, trainer = self._holding("backward"), self._prepared("backward")
        engine, clock = self._engine(trainer), trainer.probe.clock
        clock.span("forward", micro.given, time.perf_counter())
        trainer.probe.beat(1, 0)
        count = len(micro.indices)
        if micro.last:
            engine.carry_verdict(self.loss_sum + loss.detach() * count if micro.weight else self.loss_sum)
        clock.backward(lambda: (loss * (micro.weight * count)).backward())
        trainer.probe.beat(2, 0)
        if micro.weight:
            self.loss_sum = self.loss_sum + loss.detach() * count
            self.counted += count
            self.used += micro.indices
        self.micro = None
        self.holding_last = micro.last

    def step(self, optimizer: torch.optim.Optimizer | None = None, clip: float | None = None) -> bool:
        """After a step's last micro-batch: the non-finite check, the gradients clipped to a global
        norm of `clip` (the Loop's grad_clip when None; 0: none), the optimizer, zero_grad. On the
        other micro-batches it does nothing (gradients accumulate). Returns whether it stepped."""
        trainer = self._prepared("step")
        if self.micro is not None:
            raise UsageError("call gm.backward(loss) before gm.step(optimizer)")
        if not getattr(self, "holding_last", False):
            return False
        done = (self.loss_sum, self.counted, self.used)
        self.outcome = self._engine(trainer).finish_step(self.batch, self.lr, done, trainer.probe, clip)
        self.holding_last = False
        return True

    def log(self, **metrics) -> None:
        """Values for this step's row of metrics.jsonl (rank 0's). `loss` is recorded already: the
        mean over the whole global batch, every rank's samples."""
        for name, value in metrics.items():
            if name != "loss":
                self.extra[name] = float(value.detach()) if isinstance(value, torch.Tensor) else value

    # -- after the loop ------------------------------------------------------------------------

    def save(self) -> None:
        """Collective: a checkpoint (reshardable: any strategy and world size resumes it) of the
        step reached; inside the loop, of the step under way, written once it has been recorded."""
        trainer = self._prepared("save")
        if self.outcome is not None and self.outcome.step > self.step_reached:
            self.save_requested = True
        else:
            trainer.services.checkpointing.save(self.step_reached)

    def close(self) -> dict:
        """Collective: the final evaluation, checkpoint and weights (model.safetensors), the
        summary (summary.json, returned) and the end of the process group."""
        summary = {}
        trainer = self.trainer
        if trainer is not None and hasattr(trainer, "services"):
            if self.outcome is not None and self.outcome.step > self.step_reached:  # left the loop after gm.step
                self.step_reached = self._after_step(trainer, self.outcome.step)
            if self.step_reached < trainer.train.max_steps:  # the loop stopped early: end at the step it reached
                trainer.parts = dataclasses.replace(
                    trainer.parts, train=dataclasses.replace(trainer.train, max_steps=self.step_reached)
                )
            summary = trainer.end(self.start_step, time.perf_counter() - self.started)
            trainer.print_summary()
        self.session.close()
        return summary

    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def world_size(self) -> int:
        return self.session.world_size

    @property
    def device(self) -> torch.device:
        return self.session.device

    def _set_lr(self, step: int) -> None:
        factor = self.lr_schedule(step) if self.lr_schedule else 1.0
        groups = self._engine(self._prepared("batches")).optimizer.param_groups
        for group, base in zip(groups, self.base_lrs):
            group["lr"] = base * factor
        self.lr = groups[0]["lr"]

    @staticmethod
    def _engine(trainer: Trainer) -> CollectiveEngine:
        assert isinstance(trainer.engine, CollectiveEngine)  # OWN_ROWS run the collective engine
        return trainer.engine

    def _prepared(self, call: str) -> Trainer:
        if self.trainer is None:
            raise UsageError(f"call gm.prepare(model, optimizer) before gm.{call}")
        return self.trainer

    def _holding(self, call: str) -> _Micro:
        if self.micro is None:
            raise UsageError(f"gm.{call} belongs inside `for step, batch in gm.batches(...)`, once per batch")
        return self.micro


def _spec(optimizer: torch.optim.Optimizer) -> tuple[type, dict]:
    """(class, the settings its constructor takes): torch keeps more in `defaults` (AdamW its
    `decoupled_weight_decay`) than the constructor accepts back."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer), {k: v for k, v in optimizer.defaults.items() if k in accepted}


def _no_loss(model, data):
    raise AssertionError("an own loop computes its loss itself")
