"""The training loop and the public API.

    session = gradmesh.init()                       # process group + topology (any world size)
    trainer = gradmesh.Trainer(session, model, per_sample_loss, dataset, train=TrainConfig(...))
    trainer.fit()                                   # global-order batches, DDP, checkpoints, metrics

The loss function returns one loss per sample. Pipeline parallelism also needs the loss split
from the model, `criterion(output, target) -> per-sample losses`, with batches (inputs, target). The trainer weights every sample by
1 / (samples in its global batch) and multiplies by the data-parallel degree, which the
strategy's gradient average divides out again: the gradient is exactly the mean over the global
batch, whatever the world size, the number of micro-batches, or a short last batch of an epoch.
"""

import json
import math
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from gradmesh import rundir
from gradmesh.config import CheckpointConfig, FaultConfig, MonitorConfig, TrainConfig
from gradmesh.data import GlobalOrderSampler, fetch
from gradmesh.comm import hooks
from gradmesh.fault import checkpoint, inplace
from gradmesh.fault.handover import hand_over
from gradmesh.fault.inject import Injector, parse_faults
from gradmesh.fault.watchdog import Watchdog
from gradmesh.errors import UsageError
from gradmesh.monitor import consistency, trace
from gradmesh.monitor.breakdown import NullClock
from gradmesh.monitor.monitor import Monitor
from gradmesh.monitor.progress import TrainingProgress, print_pipeline_plan, print_summary
from gradmesh.monitor.reporter import StepRecord, StepReporter
from gradmesh.parallel import (apply_strategy, build_optimizer, clip_gradients, grad_sync, model_state_bytes,
                               resolve_strategy)
from gradmesh.parallel.pipeline import PipelineOptions, padded_rows
from gradmesh.topology import Topology, job_store, resolve_device

LossFn = Callable[[nn.Module, object], torch.Tensor]
OptimizerSpec = tuple[type[torch.optim.Optimizer], dict]


class Session:
    """A started topology: what `gradmesh.init()` returns."""

    def __init__(self, topology: Topology, membership: "inplace.Membership | None" = None):
        self.topology = topology
        self.membership = membership
        """In-place recovery's view of the job (None without --recovery inplace)."""

    @property
    def identity(self) -> int:
        """The rank this worker was started as (it keeps it when in-place recovery renumbers ranks)."""
        return self.membership.identity if self.membership else self.topology.rank

    @property
    def joined(self) -> bool:
        """A replacement worker admitted into a running job (its state comes from a live peer)."""
        return bool(self.membership and self.membership.identity in self.membership.newcomers)

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def device(self) -> torch.device:
        return self.topology.device

    def prepare(self, model: nn.Module, strategy="ddp") -> nn.Module:
        """Apply a strategy to a plain model (moves it to this rank's device)."""
        return apply_strategy(model, self.topology, strategy)

    def close(self) -> None:
        self.topology.stop()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def init(device: str = "auto", mesh: dict[str, int] | None = None, seed: int = 0) -> Session:
    """Join the job started by `gradmesh run` / torchrun, or become rank 0 of 1 under plain python.

    Seeds torch with `seed` so a model built next has the same initial weights on every rank
    and at every world size.
    """
    torch.manual_seed(seed)
    if not inplace.enabled():
        return Session(Topology.from_env(device=device, mesh_shape=mesh).start())
    membership = inplace.Membership(job_store(), job_store())
    if not inplace.joining():
        return Session(Topology.from_env(device=device, mesh_shape=mesh).start(), membership)
    while True:  # a replacement worker: wait to be admitted, then form the group with the members
        members = membership.wait_for_admission()
        try:
            membership.gather()
            break
        except inplace.Regroup:
            continue
    env = os.environ
    topology = Topology(rank=members.index(membership.identity), world_size=len(members),
                        local_rank=int(env.get("LOCAL_RANK", 0)), local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
                        device_type=resolve_device(device), mesh_shape={"dp": len(members)})
    return Session(topology.start(membership.generation), membership)


def optimizer_spec(train: TrainConfig) -> "OptimizerSpec":
    """(optimizer class, keyword arguments) from the config's adamw|sgd choice."""
    if train.optimizer == "sgd":
        return torch.optim.SGD, {"lr": train.lr, "momentum": train.momentum, "weight_decay": train.weight_decay}
    return torch.optim.AdamW, {"lr": train.lr, "weight_decay": train.weight_decay}


def lr_factor(step: int, train: TrainConfig) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr over decay_steps (a function of step only)."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, train.decay_steps - train.warmup_steps))
    floor = train.min_lr / train.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Trainer:
    """Runs `train.max_steps` optimizer steps of `model` on `dataset` across the session's ranks."""

    def __init__(self, session: Session, model: nn.Module, loss_fn: LossFn, dataset, *,
                 train: TrainConfig | None = None, checkpointing: CheckpointConfig | None = None,
                 optimizer: OptimizerSpec | None = None, run_dir: str | Path | None = None,
                 eval_fn: Callable[[nn.Module], dict] | None = None, quiet: bool = False,
                 run_info: dict | None = None, criterion: Callable | None = None,
                 faults: FaultConfig | None = None, monitor: MonitorConfig | None = None):
        self.session, self.topo = session, session.topology
        self.train = train or TrainConfig()
        self.checkpointing = checkpointing or CheckpointConfig()
        self.faults = faults or FaultConfig()
        # Set by torch elastic: > 0 when this worker group was restarted after a failure.
        self.restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        self.membership, self.identity = session.membership, session.identity
        self.monitor = Monitor(monitor or MonitorConfig(), Path(run_dir) if run_dir else None, self.identity,
                               self.topo.is_main, same_work="pp" not in self.topo.mesh_shape)
        self.clock = self.monitor.clock or NullClock()
        self._slept = self._own_time = 0.0
        self._diverged = False
        self.injector = Injector(parse_faults(self.faults.inject), self.identity, run_dir)
        self.watchdog = None
        self.loss_fn, self.dataset, self.eval_fn = loss_fn, dataset, eval_fn
        self.run_dir = Path(run_dir) if run_dir else None
        self.run_info = run_info or {}
        optimizer_class, kwargs = optimizer or optimizer_spec(self.train)
        pipeline_options = self._pipeline_options(criterion, optimizer_class, kwargs)
        self.strategy = resolve_strategy(self.train.strategy, self.topo, pipeline_options)
        self.model = session.prepare(model, self.strategy)
        self._register_hooks()
        self.pipeline = getattr(self.model, "pipeline", None)
        self.optimizer = build_optimizer(self.model, self.topo, self.strategy, optimizer_class, kwargs)
        self._base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.sampler = GlobalOrderSampler(len(dataset), self.train.global_batch_size, self.train.seed)
        self.progress = TrainingProgress(self.train.max_steps, enabled=self.topo.is_main and not quiet)
        self.quiet = quiet
        self._start_reporting()
        self.joined = session.joined
        if self.joined:
            self._after_regroup([])

    def _start_reporting(self) -> None:
        """The step reporter and the checkpointer: each has a process group of its own (collective)."""
        self.reporter = StepReporter(self.topo.world_size, self.train.log_every,
                                     self.run_dir / "metrics.jsonl" if self.run_dir and self.topo.is_main else None,
                                     on_record=self._show, membership=self.session.membership,
                                     on_row=self.monitor.on_row if self.topo.is_main else None,
                                     with_breakdown=self.monitor.clock is not None)
        self.checkpointer = None
        if self.run_dir:
            self.checkpointer = checkpoint.Checkpointer(self.run_dir, self.strategy, self.checkpointing.keep,
                                                        self.checkpointing.async_save,
                                                        on_written=self.injector.at_checkpoint)

    def _pipeline_options(self, criterion, optimizer_class, kwargs) -> PipelineOptions | None:
        if "pp" not in self.topo.mesh_shape:
            return None
        if criterion is None:
            raise UsageError("pipeline parallelism needs Trainer(..., criterion=fn) with fn(output, target) -> "
                             "per-sample losses: the last stage computes the loss, not the model")
        train = self.train
        self._pipeline_rows = padded_rows(train.global_batch_size // self.topo.dp_size, train.microbatches)
        rows = self._pipeline_rows // train.microbatches
        slots = 2 if issubclass(optimizer_class, (torch.optim.Adam, torch.optim.AdamW)) else int(kwargs.get("momentum", 0) > 0)
        return PipelineOptions(criterion, schedule=train.pp_schedule, microbatches=train.microbatches,
                               split=train.split_points, optimizer_slots=slots,
                               example=self._to_device(fetch(self.dataset, list(range(rows)))))

    # -- one optimizer step -------------------------------------------------------------------

    def _micro_batches(self, batch) -> list[tuple[list[int], float]]:
        """(indices, weight per sample) for each micro-batch this rank runs."""
        weight = self.topo.dp_size / batch.size
        runs = [(m, weight) for m in batch.micro_batches if m]
        # A rank whose share is empty (end of an epoch) still joins the gradient all-reduce:
        # it runs one sample at weight 0.
        return runs or [([batch.indices[0]], 0.0)]

    def _to_device(self, data):
        if isinstance(data, torch.Tensor):
            return data.to(self.topo.device, non_blocking=True)
        if isinstance(data, (tuple, list)):
            return type(data)(self._to_device(d) for d in data)
        if isinstance(data, dict):
            return {k: self._to_device(v) for k, v in data.items()}
        return data

    def _set_lr(self) -> float:
        factor = lr_factor(self.sampler.step - 1, self.train)
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = base * factor
        return self.optimizer.param_groups[0]["lr"]

    def _forward_backward(self, batch) -> tuple[torch.Tensor, int]:
        """Gradients of one global batch's share; returns the share's loss sum and sample count."""
        runs = self._micro_batches(batch)
        loss_sum, counted = torch.zeros((), device=self.topo.device), 0
        clock = self.clock
        for i, (indices, weight) in enumerate(runs):
            with clock.phase("data"):
                data = self._to_device(fetch(self.dataset, indices))
            with grad_sync(self.model, self.strategy, last_micro_batch=i == len(runs) - 1):
                with clock.phase("forward"):
                    if i == 0:
                        self._slow_down()
                    losses = self.loss_fn(self.model, data)
                self._beat(1, i)
                clock.backward(lambda: (losses.sum() * weight).backward())
            self._beat(2, i)
            if weight:
                loss_sum += losses.detach().sum()
                counted += len(indices)
        return loss_sum, counted

    def _pipeline_forward_backward(self, batch) -> tuple[torch.Tensor, int]:
        """The share padded to a fixed size with weight-0 samples, run by the pipeline schedule."""
        indices = [i for m in batch.micro_batches for i in m]
        pad = self._pipeline_rows - len(indices)
        with self.clock.phase("data"):
            weights = torch.tensor([self.topo.dp_size / batch.size] * len(indices) + [0.0] * pad, device=self.topo.device)
            inputs, targets = self._to_device(fetch(self.dataset, indices + [batch.indices[0]] * pad))
        # The schedule interleaves forward and backward: one phase, less its send/recv waits (comm).
        with (grad_sync(self.model, self.strategy, last_micro_batch=True), self.clock.phase("forward"),
              hooks.timed_pipeline_p2p(self.monitor.clock)):
            self._slow_down()
            loss_sum = torch.tensor(self.pipeline.step(inputs, targets, weights))
        return loss_sum, len(indices) if self.pipeline.is_last else 0

    def _slow_down(self) -> None:
        """An injected straggler sleeps inside the forward phase: it shows as slow compute."""
        self._slept += self.injector.slow_down(self._own_time)

    def _step(self, batch) -> torch.Tensor:
        """One optimizer step; returns this rank's figures for the step reporter."""
        if self.pipeline:
            loss_sum, counted = self._pipeline_forward_backward(batch)
        else:
            loss_sum, counted = self._forward_backward(batch)
        with self.clock.phase("optimizer"):
            if self.train.grad_clip:
                clip_gradients(self.model, self.train.grad_clip)
            self.optimizer.step()
        self._beat(3)
        # Measured here, where parameters, gradients and optimizer state all exist.
        figures = torch.tensor([0.0, counted, model_state_bytes(self.model, self.optimizer),
                                peak_memory_bytes(self.topo.device)], dtype=torch.float64)
        figures[0] = loss_sum.detach().to("cpu", torch.float64)
        self.optimizer.zero_grad(set_to_none=True)
        return figures

    # -- the loop -----------------------------------------------------------------------------

    def fit(self) -> dict:
        if self.run_dir and self.topo.is_main and not self.joined:
            rundir.ensure_writable(self.run_dir)
            if not (self.checkpointing.resume or self.restarted):
                rundir.clear_previous_run(self.run_dir)
            if self.pipeline:
                (self.run_dir / "pipeline.json").write_text(json.dumps(self.pipeline.plan, indent=1))
        if self.pipeline and self.topo.is_main and not self.quiet:
            print_pipeline_plan(self.pipeline.plan)
        if self.joined:  # a replacement: the state came from a live peer
            start_step = self.sampler.step
        else:
            dist.barrier()
            start_step = self._maybe_resume()
        self.progress.start = start_step
        samples = self._samples_before(start_step)
        wall_start, train_time, loss = time.perf_counter(), 0.0, float("nan")
        records = self._open_rank_file("samples") if self.train.record_samples else None
        if self.faults.step_timeout:
            self.watchdog = Watchdog(self.faults.step_timeout, self.identity, self.topo.world_size, self.run_dir)
            if self.membership:
                self.watchdog.ranks = list(self.membership.members)
        self.monitor.start()
        for step in range(start_step + 1, self.train.max_steps + 1):
            self.step_now = step
            self._beat(0)
            self.injector.before_step(step)
            tic = time.perf_counter()
            if self.monitor.clock:
                self.monitor.clock.begin(step)
            self._slept = 0.0
            batch, lr, figures = self._recoverable_step()
            self.injector.after_step(step, self.model)
            elapsed = time.perf_counter() - tic
            self._own_time = elapsed - self._slept
            figures = torch.cat([figures, torch.tensor(self.monitor.step_figures(step), dtype=torch.float64)])
            train_time += elapsed
            samples += batch.size
            self.reporter.add(StepRecord(step, batch.epoch, batch.size, samples, lr, elapsed, figures))
            if records:
                used = [i for m in batch.micro_batches for i in m]
                records.write(json.dumps({"step": step, "epoch": batch.epoch, "indices": used}) + "\n")
            if self.watchdog:
                self.watchdog.pause()  # evaluation and checkpoints are not steps
            if self.train.eval_every and step % self.train.eval_every == 0 and step < self.train.max_steps:
                self._log_eval(step, self.evaluate())
            if self.checkpointing.every and step % self.checkpointing.every == 0:
                self.save_checkpoint(step)
            if self.monitor.config.check_every and step % self.monitor.config.check_every == 0:
                self._check_replicas(step)
        if self.watchdog:
            self.watchdog.stop()
        if self.membership:
            self.membership.finish()
        self.reporter.flush()
        loss = self.history[-1]["loss"] if self.history else float("nan")
        if records:
            records.close()
        if self.monitor.clock and self.monitor.clock.trace_range:
            trace.gather_and_write(self.monitor.clock.events, self.topo.rank, self.topo.world_size, self.reporter.group,
                                   self.run_dir / "trace.json" if self.run_dir else None)
        self.progress.close()
        return self._finish(loss, samples, time.perf_counter() - wall_start, train_time, start_step)

    def _register_hooks(self) -> None:
        """gradmesh's all-reduce hook on DDP: timed by the monitor, guarded under in-place recovery."""
        ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        if ddp and (self.membership is not None or self.monitor.clock is not None):
            hooks.register(self.model, self.membership, self.monitor.clock)

    def _recoverable_step(self):
        """One step; under in-place recovery, a lost member makes the survivors regroup and redo
        it, and replacement workers are admitted between steps."""
        while True:
            if self.membership and self.membership.admits_now(self.sampler.step + 1, self.train.max_steps):
                self.reporter.flush()  # every member is at this step boundary: nothing is lost
                self.membership.next()
                self._regroup(None)
            position = self.sampler.state_dict()
            try:
                batch = self.sampler.next_batch(self.topo.dp_rank, self.topo.dp_size, self.train.grad_accum)
                lr = self._set_lr()  # a function of the step the sampler is now at
                return batch, lr, self._step(batch)
            except RuntimeError as err:  # gloo reports a lost peer as a RuntimeError subclass
                if self.membership is None:
                    raise
                self.sampler.load_state_dict(position)
                self.optimizer.zero_grad(set_to_none=True)  # the failed step never reached the optimizer
                self.membership.next()
                self._regroup(err)

    def _regroup(self, err: Exception | None) -> None:
        """Form the group of the membership's current generation and go on from the same step.

        After a loss, parameters and optimizer state are untouched (the failed step never
        reached the optimizer) and the sampler is back at the failed step, which now splits
        over fewer ranks; newcomers get the state from the new rank 0."""
        membership = self.membership
        while True:
            if membership.identity not in membership.members:
                raise err or RuntimeError("in-place recovery: this worker was dropped from the job")
            try:
                membership.gather()
                break
            except inplace.Regroup:  # another loss (or an admission) meanwhile: the newest generation
                membership.next()
        pending = self.reporter.abandon()
        rank, world = membership.members.index(self.identity), len(membership.members)
        self.topo.retired.append(self.model)
        self.topo.rejoin(rank, world, membership.generation)
        self.model = apply_strategy(self.model.module, self.topo, self.strategy)  # rank 0's weights to all
        self._register_hooks()
        self._start_reporting()
        self._after_regroup(pending)

    def _after_regroup(self, pending: list[StepRecord]) -> None:
        """Every member of a new group, the newcomers included, runs this in the same order."""
        membership = self.membership
        if membership.newcomers:
            pending = hand_over(self, pending)
        where = torch.tensor([self.sampler.step, -self.sampler.step], dtype=torch.int64)
        dist.all_reduce(where, op=dist.ReduceOp.MIN)
        if where[0].item() != -where[1].item():
            raise RuntimeError("in-place recovery: the members stopped at different steps; use --recovery restart")
        self.reporter.resend(pending)
        self.progress.enabled = self.topo.is_main and not self.quiet
        if self.watchdog:
            self.watchdog.ranks = list(membership.members)
        joined = f"; rank(s) {', '.join(map(str, membership.newcomers))} joined" if membership.newcomers else ""
        self.progress.note(f"gradmesh: in-place recovery: {self.topo.world_size} rank(s) go on from step "
                           f"{self.sampler.step + 1} (generation {membership.generation}{joined}; "
                           f"rank {self.identity} is now rank {self.topo.rank})")

    def _check_replicas(self, step: int) -> None:
        """Data-parallel replicas (ddp, zero1) compare parameter checksums; rank 0 reports a divergence."""
        if self.monitor.clock is None or self.strategy.name not in ("ddp", "zero1") or set(self.topo.mesh_shape) != {"dp"}:
            return
        if self.topo.world_size < 2:
            return
        found = consistency.compare_replicas(self.model.module, self.reporter.group, self.topo.world_size)
        reported, self._diverged = self._diverged, bool(found)
        if found and self.topo.is_main and not reported:  # once, until the replicas agree again
            ranks = ", ".join(map(str, found["ranks"]))
            self.monitor.alert({"step": step, "kind": "divergence", "rank": found["ranks"][0], "tensor": found["tensor"],
                                "message": f"replicas diverged by step {step}: rank(s) {ranks} differ from the others, "
                                           f"first in {found['tensor']!r} ({found['differing_tensors']} tensor(s) differ)"})

    def _beat(self, phase: int, micro: int = 0) -> None:
        if self.watchdog:
            self.watchdog.beat(self.step_now, phase, micro)

    def evaluate(self) -> dict:
        if self.eval_fn is None:
            return {}
        model = self.pipeline.full_model() if self.pipeline else self.model
        was_training = model.training
        model.eval()
        with torch.no_grad():
            metrics = self.eval_fn(model)
        model.train(was_training)
        return metrics

    def _samples_before(self, step: int) -> int:
        """Samples consumed by the first `step` steps (only an epoch's last batch is short)."""
        epochs, rest = divmod(step, self.sampler.batches_per_epoch)
        return epochs * self.sampler.dataset_len + rest * self.train.global_batch_size

    def _show(self, row: dict) -> None:
        self.progress.update(row["step"], row["loss"], row["samples_per_s"])

    @property
    def history(self) -> list[dict]:
        """Per-step records (as in metrics.jsonl) of this run, up to the last reported step."""
        return self.reporter.history

    def _log_eval(self, step: int, metrics: dict) -> None:
        if metrics and self.topo.is_main:
            self.progress.note(f"step {step} eval " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def _open_rank_file(self, kind: str):
        if not self.run_dir:
            return None
        return open(self.run_dir / f"{kind}-rank{self.identity}.jsonl", "a", buffering=1)

    # -- checkpoints and the end of a run -----------------------------------------------------

    def save_checkpoint(self, step: int) -> None:
        if self.checkpointer is None:
            return
        self.reporter.flush()  # the metrics of every step the checkpoint covers are on disk with it
        state = {"step": step, "sampler": self.sampler.state_dict(), "world_size": self.topo.world_size,
                 "strategy": self.strategy.name, "run": self.run_info}
        with self.monitor.timed("checkpoint", step):  # checkpoint I/O, outside the step's phases
            self.checkpointer.save(step, self.model, self.optimizer, state)

    def _maybe_resume(self) -> int:
        if not ((self.checkpointing.resume or self.restarted) and self.checkpointer):
            return 0
        # Rank 0 verifies checksums and picks the newest intact checkpoint for everyone.
        chosen = torch.tensor([-1], dtype=torch.int64)
        if self.topo.is_main:
            path = checkpoint.latest_good_checkpoint(self.run_dir, warn=self.progress.note)
            chosen[0] = int(path.name.split("-")[1]) if path else -1
        dist.broadcast(chosen, src=0, group=self.checkpointer.group)
        if chosen.item() < 0 and self.restarted and not self.checkpointing.resume:
            self._forget_steps_after(0)  # failed before its first checkpoint: start again
            return 0
        if chosen.item() < 0:
            raise checkpoint.CheckpointError(f"--resume: no intact checkpoint under {self.run_dir / 'checkpoints'}")
        path = checkpoint.checkpoint_root(self.run_dir) / f"step-{chosen.item()}"
        state = self.checkpointer.load(path, self.model, self.optimizer)
        self.sampler.load_state_dict(state["sampler"])
        self._forget_steps_after(state["step"])
        self.progress.note(f"resumed from {path} (step {state['step']}, written by {state.get('strategy')} "
                           f"at world size {state.get('world_size')})")
        return state["step"]

    def _forget_steps_after(self, step: int) -> None:
        """Records of steps after the checkpoint go: the resumed run does them again, once."""
        if self.topo.is_main:
            rundir.truncate_steps(self.run_dir / "metrics.jsonl", step)
        rundir.truncate_steps(self.run_dir / f"samples-rank{self.identity}.jsonl", step)
        rundir.truncate_steps(self.run_dir / f"steps-rank{self.identity}.jsonl", step)
        if self.topo.is_main:
            rundir.truncate_steps(self.run_dir / "alerts.jsonl", step)

    def _finish(self, loss: float, samples: int, wall: float, train_time: float, start_step: int) -> dict:
        eval_metrics = self.evaluate()
        steps = self.train.max_steps - start_step
        if self.run_dir and steps and (self.checkpointing.every == 0 or self.train.max_steps % self.checkpointing.every):
            self.save_checkpoint(self.train.max_steps)
        if self.checkpointer:
            self.checkpointer.wait()
        if self.pipeline:
            weights = {k: v.cpu() for k, v in self.pipeline.full_model().state_dict().items()}
        else:
            weights = checkpoint.full_model_state(self.model)
        peaks = torch.tensor([peak_memory_bytes(self.topo.device)], dtype=torch.int64, device=self.topo.device)
        gathered = [torch.zeros_like(peaks) for _ in range(self.topo.world_size)]
        dist.all_gather(gathered, peaks)
        summary = {
            "steps": self.train.max_steps, "steps_this_run": steps, "samples": samples,
            "wall_s": wall, "train_s": train_time,
            "samples_per_s": (samples - self._samples_before(start_step)) / train_time if train_time else 0.0,
            "final_loss": loss, "eval": eval_metrics, "world_size": self.topo.world_size,
            "strategy": self.strategy.name, "peak_memory_bytes": [int(t.item()) for t in gathered],
            "model_state_bytes": self.history[-1]["model_state_bytes"] if self.history else [],
            "run_dir": str(self.run_dir) if self.run_dir else "", **self.run_info,
            **(self.monitor.summary(self.history) if self.topo.is_main else {}),
        }
        self.final_weights = weights if self.topo.is_main else None
        if self.topo.is_main and self.run_dir:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in weights.items()}, str(self.run_dir / "model.safetensors"))
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.summary = summary
        self.monitor.close()
        return summary

    def print_summary(self, sample: str | None = None) -> None:
        if self.topo.is_main and not self.quiet:
            print_summary(self.summary, sample)
