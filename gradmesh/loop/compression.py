"""`--compression auto`'s one decision, made on every data-parallel rank at the same step."""

import json

from gradmesh.comm.auto import DECIDE_AFTER, AutoCompression, decide, probe_bandwidth
from gradmesh.comm.compress import reducer_for
from gradmesh.files import atomic_write
from gradmesh.loop.services import Notes, RunContext, Service, largest


class CompressionChoice(Service):
    lockstep = True

    def __init__(self, ctx: RunContext, reporting: Notes, auto: AutoCompression, feedback_ok: bool):
        self.ctx, self.reporting, self.auto, self.feedback_ok = ctx, reporting, auto, feedback_ok
        self.at = DECIDE_AFTER

    def start(self, first_step: int) -> None:
        self.at = first_step + DECIDE_AFTER  # a resumed run measures its own link again

    def after_step(self, outcome, elapsed: float) -> None:
        if outcome.step != self.at:
            return
        topology = self.ctx.topology
        group = topology.group("dp")
        figures = probe_bandwidth(group, topology.device)
        step_s = largest(elapsed, group)
        shapes = [p.shape for p in self.ctx.engine.model.parameters() if p.requires_grad]
        figures.update(
            decide(shapes, topology.dp_size, figures["bandwidth_Bps"], step_s, self.feedback_ok),
            step=outcome.step,
            ranks=topology.dp_size,
        )
        chosen = reducer_for(figures["choice"])
        if chosen is not None:
            self.auto.choose(chosen)
        if self.ctx.is_main:
            if self.ctx.run_dir:
                atomic_write(self.ctx.run_dir / "compression.json", json.dumps(figures, indent=1))
            self.reporting.note(
                f"--compression auto: {figures['choice']} from step {outcome.step + 1} "
                f"(link {figures['bandwidth_Bps'] * 8 / 1e6:,.0f} Mbit/s; {figures['reason']})"
            )
