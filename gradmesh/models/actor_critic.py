"""A small actor-critic for low-dimensional observations (rl-cartpole): a tanh MLP torso, a policy
head (logits over discrete actions) and a value head."""

import torch
import torch.nn as nn


class ActorCritic(nn.Module):
    def __init__(self, observations: int = 4, actions: int = 2, hidden: int = 64):
        super().__init__()
        self.torso = nn.Sequential(nn.Linear(observations, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.policy = nn.Linear(hidden, actions)
        self.value = nn.Linear(hidden, 1)

    def forward(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(action logits [N, actions], state values [N])."""
        features = self.torso(observations)
        return self.policy(features), self.value(features).squeeze(-1)
