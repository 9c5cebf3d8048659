"""The collective SPMD engine: ddp, zero1, fsdp, tp and their meshes.

Every rank runs the same step at the same moment: its share of the global batch in
`grad_accum` micro-batches, gradients synchronised on the last one by whatever the plan's rows
do (DDP's bucketed all-reduce through gradmesh's reducer, FSDP's reduce-scatter, the flat
average beside tensor parallelism), then the optimizer.
"""

import torch

from gradmesh.data import GlobalBatch, fetch
from gradmesh.engine.base import Engine, StepProbe, to_device
from gradmesh.parallel import batchnorm


class CollectiveEngine(Engine):
    def micro_batches(self, batch: GlobalBatch, rank: int | None = None) -> list[tuple[list[int], float]]:
        """(indices, weight per sample) for each micro-batch data-parallel rank `rank` (this one
        by default) runs."""
        topo = self.topology
        weight = self.weight / batch.size
        share = batch.share(topo.dp_rank if rank is None else rank, topo.dp_size, self.job.train.grad_accum)
        runs = [(m, weight) for m in share if m]
        # A rank whose share is empty (end of an epoch) still joins the gradient all-reduce:
        # it runs one sample at weight 0.
        return runs or [([batch.indices[0]], 0.0)]

    def runs(self, batch: GlobalBatch) -> tuple[list[tuple[list[int], float]], list[list[list[int]]] | None]:
        """This rank's micro-batches — as many as the most any rank runs where every forward is a
        collective (`Plan.equal_micro_batches`; the extra ones are one sample at weight 0) — and,
        where the plan reads every rank's share (`Plan.reads_every_share`), every data-parallel
        rank's indices per micro-batch (None elsewhere)."""
        plan = self.plan
        if not (plan.equal_micro_batches or self.norms):  # a synchronised norm's forward is a collective too
            return self.micro_batches(batch), None
        everyone = [self.micro_batches(batch, rank) for rank in range(self.topology.dp_size)]
        most = max(len(runs) for runs in everyone)
        padded = [runs + [([batch.indices[0]], 0.0)] * (most - len(runs)) for runs in everyone]
        shares = [[runs[i][0] for runs in padded] for i in range(most)] if plan.reads_every_share else None
        return padded[self.topology.dp_rank], shares

    def forward_backward(self, batch: GlobalBatch, probe: StepProbe):
        runs, every = self.runs(batch)
        loss_sum, counted, used = torch.zeros((), device=self.topology.device), 0, []
        clock = probe.clock
        for i, (indices, weight) in enumerate(runs):
            with clock.phase("data"):
                data = to_device(fetch(self.job.dataset, indices), self.topology.device)
                if every is not None:
                    self.show_every_share(data, [fetch(self.job.dataset, share) for share in every[i]])
            with self.sync(last_micro_batch=i == len(runs) - 1):
                padding = batchnorm.counting(self.norms, weight > 0)  # takes no part in batch statistics
                with clock.phase("forward"), probe.around_forward(len(indices) if i == 0 else 0), padding:
                    losses = self.job.loss_fn(self.model, data)
                    if i == 0:
                        probe.in_forward()
                        losses = probe.spoil(losses)
                probe.beat(1, i)
                if i == len(runs) - 1:
                    self.carry_verdict(loss_sum + losses.detach().sum() if weight else loss_sum)
                clock.backward(lambda: (losses.sum() * weight).backward())  # noqa: B023 (called at once)
            probe.beat(2, i)
            if weight:
                loss_sum += losses.detach().sum()
                counted += len(indices)
                used += indices
        return loss_sum, counted, used
