"""What an actor does: step its vectorised environments with the policy it last pulled, and cut the
experience into trajectories of a fixed shape that travel as one flat float32 tensor.

The environments are Gymnasium's CartPole-v1 in its numpy-vectorised form (`gymnasium.make_vec`
with the vector entry point: every environment stepped by one batch of array operations, no
process or thread per environment). Its autoreset is Gymnasium's NEXT_STEP: the step after an
episode ends returns the fresh start with reward 0 and ignores its action, so `dones` is kept per
observation (`dones[t]`: observation t ended an episode) and the loss leaves out the steps taken
from such an observation (`vtrace.actor_critic_loss`).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ENV_ID = "CartPole-v1"
OBSERVATIONS, ACTIONS = 4, 2


@dataclass(frozen=True)
class Trajectory:
    """One unroll of T steps of E environments (or, stacked along dimension 1, a learner's batch)."""

    observations: torch.Tensor
    """[T + 1, E, observation size]: the last one is what the next trajectory starts from."""
    dones: torch.Tensor
    """[T + 1, E]: 1 where the observation is an episode's last one."""
    actions: torch.Tensor
    """[T, E] (whole numbers, held as float32 to travel in one tensor)."""
    behaviour: torch.Tensor
    """[T, E]: log mu(a_t | x_t) of the policy the actor acted with."""
    rewards: torch.Tensor
    """[T, E]."""


@dataclass(frozen=True)
class Layout:
    """Where each field lies in a trajectory's flat tensor (the wire's payload)."""

    unroll: int
    envs: int
    observations: int = OBSERVATIONS

    def shapes(self) -> list[tuple[int, ...]]:
        steps, envs = self.unroll, self.envs
        return [(steps + 1, envs, self.observations), (steps + 1, envs), (steps, envs), (steps, envs), (steps, envs)]

    @property
    def size(self) -> int:
        return sum(int(torch.Size(shape).numel()) for shape in self.shapes())

    @property
    def steps(self) -> int:
        """Environment steps in one trajectory."""
        return self.unroll * self.envs

    def pack(self, trajectory: Trajectory) -> torch.Tensor:
        fields = (
            trajectory.observations,
            trajectory.dones,
            trajectory.actions,
            trajectory.behaviour,
            trajectory.rewards,
        )
        return torch.cat([field.reshape(-1) for field in fields]).float()

    def unpack(self, flat: torch.Tensor) -> Trajectory:
        sizes = [int(torch.Size(shape).numel()) for shape in self.shapes()]
        parts = [piece.reshape(shape) for piece, shape in zip(flat.split(sizes), self.shapes())]
        return Trajectory(*parts)


def stack(trajectories: list[Trajectory]) -> Trajectory:
    """Trajectories side by side (dimension 1): one batch for the learner."""
    fields = ("observations", "dones", "actions", "behaviour", "rewards")
    return Trajectory(*(torch.cat([getattr(t, name) for t in trajectories], dim=1) for name in fields))


class Environments:
    """E CartPole-v1 environments stepped together."""

    def __init__(self, envs: int, seed: int):
        import gymnasium  # on the actors only: the learners and the launcher need none

        self.env = gymnasium.make_vec(ENV_ID, num_envs=envs, vectorization_mode="vector_entry_point")
        observations, _ = self.env.reset(seed=seed)
        self.observations = torch.from_numpy(observations)
        self.dones = torch.zeros(envs)

    def step(self, actions: torch.Tensor) -> None:
        observations, rewards, terminated, truncated, _ = self.env.step(actions.numpy())
        self.observations = torch.from_numpy(observations)
        self.dones = torch.from_numpy(terminated | truncated).float()
        self.rewards = torch.from_numpy(rewards).float()


class Actor:
    """A policy network and its environments; `rollout` acts T steps with the current weights."""

    def __init__(self, net: torch.nn.Module, layout: Layout, seed: int):
        self.net, self.layout = net, layout
        self.envs = Environments(layout.envs, seed)
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def rollout(self) -> Trajectory:
        steps, envs = self.layout.unroll, self.layout.envs
        observations = torch.empty(steps + 1, envs, self.layout.observations)
        dones = torch.empty(steps + 1, envs)
        actions, behaviour, rewards = (torch.empty(steps, envs) for _ in range(3))
        observations[0], dones[0] = self.envs.observations, self.envs.dones
        for t in range(steps):
            logits, _ = self.net(observations[t])
            log_probs = F.log_softmax(logits, dim=-1)
            action = torch.multinomial(log_probs.exp(), 1, generator=self.generator).squeeze(-1)
            behaviour[t] = log_probs.gather(-1, action[:, None]).squeeze(-1)
            self.envs.step(action)
            actions[t], rewards[t] = action, self.envs.rewards
            observations[t + 1], dones[t + 1] = self.envs.observations, self.envs.dones
        return Trajectory(observations, dones, actions, behaviour, rewards)
