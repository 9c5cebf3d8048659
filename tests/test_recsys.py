"""The recsys workload (issue 15): a DLRM-style model on a synthetic click log whose Bayes-optimal
AUC is known, so a trained model is judged against the ceiling."""

import torch

from helpers import summary

SMALL = ("--model", "recsys", "--set", "model.rows=4000", "--set", "model.samples=100000",
         "--max-steps", "350", "--global-batch-size", "256")


def test_the_click_log_is_deterministic_and_its_ids_follow_zipf():
    from gradmesh.data.clicks import ClickSpec, generate

    spec = ClickSpec(rows=(500, 500), samples=200_000, zipf=1.2)
    (train, held_out), (again, _) = generate(spec), generate(spec)
    assert torch.equal(train.ids, again.ids) and torch.equal(train.clicks, again.clicks)
    assert len(train) + len(held_out) == spec.samples and train.ids.max() < 500
    counts = torch.bincount(train.ids[:, 0], minlength=500).sort(descending=True).values.double()
    assert abs(counts[0] / counts[1] - 2**1.2) < 0.1  # P(rank k) ∝ k^-s: the two most popular ids
    assert abs(counts[0] / counts[3] - 4**1.2) < 0.3
    assert abs(train.clicks.mean() - train.truth.mean()) < 0.01  # clicks are drawn from the truth


def test_recsys_trains_near_the_bayes_optimal_auc(catalogue):
    run = catalogue.run(2, *SMALL, tiny=False)
    found = summary(run)["eval"]
    assert 0.85 < found["auc_ceiling"] < 1.0
    assert found["auc_ceiling"] - 0.03 <= found["auc"] <= found["auc_ceiling"]  # measured 0.022 below
    assert found["loss"] < 0.5 * (found["log_loss_ceiling"] + 0.58)  # well below a constant click rate's 0.58
