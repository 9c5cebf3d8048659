"""Reinforcement learning, actors and learners (issue 31): V-trace against a reference computed from
its definition (on-policy: the n-step returns), the wire's trajectory layout and the episode
returns it shows, bad input refused in one line, and real runs of `gradmesh train --model
rl-cartpole`: learning progress with every trajectory sent applied exactly once, and an actor
killed (SIGKILL) mid-run, dropped while the learners go on, its trajectories neither lost nor
applied twice."""

import pytest
import torch

from helpers import metrics, summary, train
from test_cli_errors import assert_usage_error

from gradmesh.engine.actor_learner.learner import Episodes
from gradmesh.engine.actor_learner.rollout import Layout, Trajectory
from gradmesh.engine.actor_learner.vtrace import vtrace


def _reference(log_rhos, discounts, rewards, values, bootstrap, rho_bar, c_bar):
    """v_s = V(x_s) + sum_{t >= s} (prod_{s <= i < t} gamma_i c_i) delta_t (Espeholt et al., eq. 1),
    term by term in float64 Python, and the advantage rho_s (r_s + gamma_s v_{s+1} - V(x_s))."""
    steps, width = rewards.shape
    rhos = torch.exp(log_rhos).double()
    vs, advantages = torch.zeros(steps, width, dtype=torch.float64), torch.zeros(steps, width, dtype=torch.float64)
    value = lambda t, b: float(bootstrap[b]) if t == steps else float(values[t, b])  # noqa: E731
    for b in range(width):
        for s in range(steps):
            total, product = value(s, b), 1.0
            for t in range(s, steps):
                rho = min(rho_bar, float(rhos[t, b]))
                delta = rho * (float(rewards[t, b]) + float(discounts[t, b]) * value(t + 1, b) - value(t, b))
                total += product * delta
                product *= float(discounts[t, b]) * min(c_bar, float(rhos[t, b]))
            vs[s, b] = total
        for s in range(steps):
            following = float(bootstrap[b]) if s == steps - 1 else float(vs[s + 1, b])
            rho = min(rho_bar, float(rhos[s, b]))
            advantages[s, b] = rho * (float(rewards[s, b]) + float(discounts[s, b]) * following - value(s, b))
    return vs, advantages


def _episode_data(steps=9, width=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(steps, width, generator=g)
    ends = torch.rand(steps, width, generator=g) < 0.2  # some episodes end inside the unroll
    discounts = 0.9 * (~ends).double()
    values, bootstrap = torch.randn(steps, width, generator=g), torch.randn(width, generator=g)
    return rewards.double(), discounts, values.double(), bootstrap.double(), g


def test_vtrace_on_policy_is_the_n_step_return():
    rewards, discounts, values, bootstrap, _ = _episode_data()
    vs, _ = vtrace(torch.zeros_like(rewards), discounts, rewards, values, bootstrap)
    steps = rewards.shape[0]
    for s in range(steps):  # sum_t (prod gamma) r_t + (prod gamma) V(x_T), cut where an episode ends
        ret, product = torch.zeros(rewards.shape[1], dtype=torch.float64), torch.ones(rewards.shape[1], dtype=torch.float64)
        for t in range(s, steps):
            ret += product * rewards[t]
            product = product * discounts[t]
        ret += product * bootstrap
        assert torch.allclose(vs[s], ret, atol=1e-12)


@pytest.mark.parametrize("rho_bar, c_bar", [(1.0, 1.0), (2.0, 0.5), (0.7, 1.3)])
def test_vtrace_off_policy_matches_its_definition(rho_bar, c_bar):
    rewards, discounts, values, bootstrap, g = _episode_data(seed=1)
    log_rhos = torch.randn(rewards.shape, generator=g).double()
    got = vtrace(log_rhos, discounts, rewards, values, bootstrap, rho_bar=rho_bar, c_bar=c_bar)
    want = _reference(log_rhos, discounts, rewards, values, bootstrap, rho_bar, c_bar)
    assert torch.allclose(got[0], want[0], atol=1e-10) and torch.allclose(got[1], want[1], atol=1e-10)


def test_a_trajectory_travels_as_one_flat_tensor_and_shows_its_episodes():
    layout = Layout(unroll=4, envs=2)
    dones = torch.tensor([[0, 0], [0, 1], [0, 0], [1, 0], [0, 0]], dtype=torch.float32)
    trajectory = Trajectory(torch.randn(5, 2, 4), dones, torch.tensor([[0, 1]] * 4).float(), torch.randn(4, 2),
                            torch.tensor([[1, 1], [1, 0], [1, 1], [0, 1]], dtype=torch.float32))
    flat = layout.pack(trajectory)
    assert flat.shape == (layout.size,) and flat.dtype == torch.float32
    back = layout.unpack(flat)
    assert all(torch.equal(getattr(back, f), getattr(trajectory, f)) for f in ("observations", "dones", "actions", "behaviour", "rewards"))
    episodes = Episodes()
    episodes.add(7, trajectory)  # env 1 ends after 1 step, env 0 after 3; the reset step's reward 0 starts nothing
    assert list(episodes.returns) == [1.0, 3.0] and episodes.count == 2
    assert episodes.running[7].tolist() == [0.0, 2.0]


RL = ["--model", "rl-cartpole"]


@pytest.mark.parametrize("args, words", [
    (["--nproc", "2", "--learners", "2"], ["--learners 2", "no actor", "--nproc 2"]),
    (["--nproc", "5", "--learners", "3"], ["--learners 3", "a learner without an actor", "1..2"]),
    (["--nproc", "2", "--learners", "0"], ["rl.learners", ">= 1"]),
    (["--nproc", "2", "--strategy", "ddp"], ["rl-cartpole", "impala", "ddp"]),
], ids=["no actor", "fewer actors than learners", "no learner", "another strategy"])
def test_bad_rl_input_is_one_line(tmp_path, cli, args, words):
    assert_usage_error(cli("train", *RL, "--run-dir", str(tmp_path / "run"), *args), *words)
    assert not (tmp_path / "run").exists()


def test_rl_options_on_another_model_are_refused(tmp_path, cli):
    run = ["--run-dir", str(tmp_path / "run"), "--model", "mlp-digits"]
    assert_usage_error(cli("train", *run, "--learners", "2"), "--learners", "rl-cartpole")
    assert_usage_error(cli("train", *run, "--strategy", "impala"), "impala", "mlp-digits")


SMALL = [*RL, "--set", "rl.target_return=120", "--set", "rl.log_every=5", "--max-steps", "3000"]
"""A run that learns (random play returns ~22) and ends within seconds."""


def _learnt(rl: dict) -> bool:
    """The target was reached (the trajectories applied after the decision to stop may move the
    last mean a little either way) and the final mean is far above random play's ~22."""
    return rl["target_reached_s"] is not None and rl["episode_return"] >= 80


def _check_counts(rl: dict, lost: set[int] = frozenset()):
    counts, actors = rl["trajectories"], rl["actor_ranks"]
    for i, rank in enumerate(actors):
        assert counts["received"][i] == counts["applied"][i] > 0, (rank, counts)
        if rank in lost:  # its last PULL said how many it had sent by then; more may have arrived whole
            assert counts["lost"][i] == 1 and counts["received"][i] >= counts["sent"][i]
        else:
            assert counts["lost"][i] == 0 and counts["sent"][i] == counts["received"][i], (rank, counts)


@pytest.mark.slow
def test_actors_and_learners_learn_and_apply_every_trajectory_once(tmp_path):
    train(tmp_path, 3, *SMALL, timeout=240)
    found = summary(tmp_path)
    rl = found["rl"]
    assert (rl["learners"], rl["actors"], found["strategy"]) == (1, 2, "impala")
    assert _learnt(rl)
    _check_counts(rl)
    rows = metrics(tmp_path)
    steps = [row["step"] for row in rows]  # a row per step once, the last at the final version
    assert steps == sorted(set(steps)) and steps[-1] == found["steps"], steps
    returns = [row["episode_return"] for row in rows if row["episode_return"] is not None]
    assert returns[0] < 60 and max(returns) >= 100  # progress from random play's ~22, not luck
    assert all(row["staleness_max"] >= 0 and len(row["actor_env_steps_per_s"]) == 2 for row in rows)
    assert sum(rl["trajectories"]["applied"]) * 16 * 32 == rl["env_steps"]


@pytest.mark.slow
def test_an_actor_killed_mid_run_is_dropped_and_the_learners_go_on(tmp_path):
    result = train(tmp_path, 3, *SMALL, "--inject", "kill:rank=2,step=20", timeout=240)
    assert "actor rank 2 was lost; the learners go on without it" in result.stderr
    rl = summary(tmp_path)["rl"]
    assert rl["lost_actors"] == [2] and _learnt(rl)
    _check_counts(rl, lost={2})
    # killed before acting its trajectory 20: trajectories 0.. arrived in order (a gap or a repeat ends
    # the run), each applied once; those after its last pull (its sends are waited for then) may
    # have been cut off in flight
    sent, received, applied = (rl["trajectories"][k][1] for k in ("sent", "received", "applied"))
    assert 0 < sent <= received == applied <= 20


@pytest.mark.slow
def test_two_learners_all_reduce_and_each_serves_its_actors(tmp_path):
    train(tmp_path, 4, *SMALL, "--learners", "2", timeout=240)
    rl = summary(tmp_path)["rl"]
    assert (rl["learners"], rl["actor_ranks"]) == (2, [2, 3]) and _learnt(rl)
    _check_counts(rl)


@pytest.mark.slow
def test_a_learner_killed_restarts_every_rank_from_the_last_checkpoint(tmp_path):
    result = train(tmp_path, 2, *SMALL, "--checkpoint-every", "20", "--inject", "kill:rank=0,step=30", timeout=240)
    assert "every rank restarts from the last checkpoint" in result.stderr, result.stderr
    found = summary(tmp_path)
    assert _learnt(found["rl"]) and found["steps"] > 30
    steps = [row["step"] for row in metrics(tmp_path)]
    assert steps == sorted(set(steps)) and 20 in steps  # the rows after the checkpoint were written once
    _check_counts(found["rl"])  # the restarted actors' trajectories, each applied once
