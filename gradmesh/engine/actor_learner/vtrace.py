"""V-trace off-policy correction (Espeholt et al., 2018, "IMPALA", section 4) and the actor-critic loss.

Written here rather than taken from a library: the published implementations are TensorFlow's
(deepmind/scalable_agent) or come inside whole RL frameworks; the computation is a short backward
recursion. Time runs along dimension 0, trajectories along dimension 1.

With importance ratios rho_t = pi(a_t|x_t) / mu(a_t|x_t), truncated as rho_t = min(rho_bar, .) and
c_t = lambda * min(c_bar, .), and delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)):

    v_s = V(x_s) + sum_{t >= s} (prod_{s <= i < t} gamma_i c_i) delta_t
        = V(x_s) + delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1}))       (the recursion used)

and the policy gradient's advantage is rho_s (r_s + gamma_s v_{s+1} - V(x_s)). On-policy (every
ratio 1) v_s is the n-step bootstrapped return, which tests/test_rl.py checks.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def vtrace(
    log_rhos: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap: torch.Tensor,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(v_s targets [T, B], policy-gradient advantages [T, B]); no gradient flows through them.

    log_rhos: log pi(a|x) - log mu(a|x); discounts: gamma_t (0 where the episode ended at t + 1);
    values: V(x_t) for t < T; bootstrap: V(x_T)."""
    with torch.no_grad():
        rhos = torch.exp(log_rhos)
        clipped = rhos.clamp(max=rho_bar)
        cs = lam * rhos.clamp(max=c_bar)
        next_values = torch.cat([values[1:], bootstrap[None]])
        deltas = clipped * (rewards + discounts * next_values - values)
        acc = torch.zeros_like(bootstrap)
        corrections = []
        for t in reversed(range(values.shape[0])):
            acc = deltas[t] + discounts[t] * cs[t] * acc
            corrections.append(acc)
        vs = values + torch.stack(corrections[::-1])
        next_vs = torch.cat([vs[1:], bootstrap[None]])
        advantages = clipped * (rewards + discounts * next_vs - values)
    return vs, advantages


@dataclass(frozen=True)
class LossWeights:
    gamma: float = 0.99
    baseline: float = 0.5
    """Weight of the value loss."""
    entropy: float = 0.01
    """Weight of the entropy bonus."""


def actor_critic_loss(net, batch, weights: LossWeights) -> tuple[torch.Tensor, int]:
    """(loss summed over the batch's valid steps, that number of steps) for trajectories stacked
    along dimension 1 (`rollout.Batch`). A step taken from a terminal observation (the vector
    environment's reset step: its action is ignored, its reward 0) is not valid and weighs nothing."""
    steps, width = batch.actions.shape
    logits, values = net(batch.observations.reshape((steps + 1) * width, -1))
    logits, values = logits.reshape(steps + 1, width, -1)[:-1], values.reshape(steps + 1, width)
    log_probs = F.log_softmax(logits, dim=-1)
    taken = log_probs.gather(-1, batch.actions.long()[..., None]).squeeze(-1)
    discounts = weights.gamma * (1.0 - batch.dones[1:])
    valid = 1.0 - batch.dones[:-1]
    vs, advantages = vtrace(
        taken.detach() - batch.behaviour, discounts, batch.rewards, values[:-1].detach(), values[-1].detach()
    )
    policy = -(taken * advantages * valid).sum()
    baseline = 0.5 * (((vs - values[:-1]) ** 2) * valid).sum()
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    loss = policy + weights.baseline * baseline - weights.entropy * (entropy * valid).sum()
    return loss, int(valid.sum().item())
