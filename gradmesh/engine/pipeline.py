"""The pipeline engine: stages of the model on different ranks, micro-batches in flight.

torch.distributed.pipelining's schedules interleave forward and backward, so a step is one
phase (less its send/recv waits, counted as communication). Each data-parallel replica's share
is padded to a fixed number of rows with weight-0 samples: the library infers shapes once.
"""

import json

import torch

from gradmesh.comm.p2p import watched_p2p
from gradmesh.data import GlobalBatch, fetch
from gradmesh.engine.base import Engine, StepProbe, to_device
from gradmesh.errors import UsageError
from gradmesh.files import atomic_write
from gradmesh.monitor.progress import print_pipeline_plan
from gradmesh.optim import optimizer_slots
from gradmesh.parallel.pipeline import PipelineOptions, padded_rows, pipeline_of


class PipelineEngine(Engine):
    def pipeline_options(self, model) -> PipelineOptions:
        job, train = self.job, self.job.train
        if job.criterion is None:
            raise UsageError(
                "pipeline parallelism needs Trainer(..., criterion=fn) with fn(output, target) -> "
                "per-sample losses: the last stage computes the loss, not the model"
            )
        self.padded = padded_rows(train.global_batch_size // self.topology.dp_size, train.microbatches)
        example = to_device(fetch(job.dataset, list(range(self.padded // train.microbatches))), self.topology.device)
        slots = optimizer_slots(job.optimizer_class, job.optimizer_kwargs)
        return PipelineOptions(
            job.criterion,
            schedule=train.pp_schedule,
            microbatches=train.microbatches,
            split=train.split_points,
            optimizer_slots=slots,
            example=example,
        )

    @property
    def pipeline(self):
        return pipeline_of(self.model)

    def forward_backward(self, batch: GlobalBatch, probe: StepProbe):
        topo = self.topology
        indices = [i for m in batch.share(topo.dp_rank, topo.dp_size, 1) for i in m]
        pad = self.padded - len(indices)
        with probe.clock.phase("data"):
            weights = torch.tensor([self.weight / batch.size] * len(indices) + [0.0] * pad, device=topo.device)
            inputs, targets = to_device(fetch(self.job.dataset, indices + [batch.indices[0]] * pad), topo.device)
        counter = self.job.counter
        assert counter is not None, "the trainer gives every job its counter"
        with self.sync(last_micro_batch=True), probe.clock.phase("forward"), watched_p2p(counter, probe.clock):
            probe.in_forward()
            loss_sum = torch.tensor(self.pipeline.step(inputs, targets, weights))
        return loss_sum, len(indices) if self.pipeline.is_last else 0, indices

    def clip(self, max_norm: float) -> None:
        self.pipeline.clip(max_norm)

    def eval_model(self):
        return self.pipeline.full_model()

    def full_state(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in self.pipeline.full_model().state_dict().items()}

    def start(self, run_dir, show: bool) -> None:
        if run_dir and self.topology.is_main:
            atomic_write(run_dir / "pipeline.json", json.dumps(self.pipeline.plan, indent=1))
        if show:
            print_pipeline_plan(self.pipeline.plan)
