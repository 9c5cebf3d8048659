"""A learner's optimisation: the V-trace actor-critic loss on a batch of trajectories, gradients
all-reduced among the learners (summed over every learner's valid steps, then divided by their
total, so several learners take the step one learner would take on all their trajectories), and
the running window of episode returns its trajectories show."""

from collections import deque

import torch
import torch.distributed as dist
import torch.nn as nn

from gradmesh.engine.actor_learner.rollout import Trajectory, stack
from gradmesh.engine.actor_learner.vtrace import LossWeights, actor_critic_loss

RETURN_WINDOW = 100
"""Episodes the mean return is taken over (the usual CartPole-v1 yardstick: solved at 475)."""


class Learner:
    """The network, its optimizer and the policy version (updates applied so far)."""

    def __init__(self, net: nn.Module, optimizer: torch.optim.Optimizer, weights: LossWeights, group, clip: float):
        self.net, self.optimizer, self.weights, self.group, self.clip = net, optimizer, weights, group, clip
        self.params = list(net.parameters())
        self.version = 0

    def weights_now(self) -> torch.Tensor:
        """A copy of the flat weights (what a PARAMS answer sends: it must not change in flight)."""
        return torch.cat([param.detach().reshape(-1) for param in self.params])

    def update(self, trajectories: list[Trajectory], extras: torch.Tensor) -> tuple[float, int, torch.Tensor]:
        """Collective over the learners: one optimizer step on every learner's trajectories
        together (none anywhere: no step). `extras` are summed with the gradients. Returns
        (loss per valid step, valid steps, summed extras)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss, steps = torch.zeros(()), 0
        if trajectories:
            loss, steps = actor_critic_loss(self.net, stack(trajectories), self.weights)
            loss.backward()
        head = torch.tensor([loss.item(), float(steps)], dtype=torch.float64)
        mine = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]  # none: an empty batch
        grads = torch.cat([grad.reshape(-1) for grad in mine]).double()
        buffer = torch.cat([grads, head, extras.double()])  # float64: counts stay exact
        dist.all_reduce(buffer, group=self.group)
        grads, head, extras = buffer.split([len(grads), len(head), len(extras)])
        total = int(head[1].item())
        if total:
            for param, mean in zip(self.params, (grads / total).float().split([p.numel() for p in self.params])):
                param.grad = mean.view_as(param).clone()
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
            self.optimizer.step()
            self.version += 1
        return head[0].item() / max(total, 1), total, extras

    def prime(self) -> None:
        """Make the optimizer's state (a step at learning rate 0 on zero gradients), so that a
        checkpoint's state has tensors to load into."""
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        for param in self.params:
            param.grad = torch.zeros_like(param)
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr


class Episodes:
    """Episode returns as the trajectories show them: a running sum per actor and environment,
    closed where an observation is an episode's last; the last RETURN_WINDOW kept."""

    def __init__(self, returns: list[float] | None = None, count: int = 0):
        self.returns: deque[float] = deque(returns or [], maxlen=RETURN_WINDOW)
        self.count = count
        self.running: dict[int, torch.Tensor] = {}

    def add(self, actor: int, trajectory: Trajectory) -> None:
        running = self.running.setdefault(actor, torch.zeros(trajectory.rewards.shape[1], dtype=torch.float64))
        for t in range(trajectory.rewards.shape[0]):
            running += trajectory.rewards[t]
            ended = trajectory.dones[t + 1].bool()
            if ended.any():
                self.returns.extend(running[ended].tolist())
                self.count += int(ended.sum().item())
                running[ended] = 0.0

    def forget(self, actor: int) -> None:
        """A lost actor's unfinished episodes never end."""
        self.running.pop(actor, None)

    def sums(self) -> tuple[float, int]:
        """(sum, number) of the returns in the window."""
        return float(sum(self.returns)), len(self.returns)
