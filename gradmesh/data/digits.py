"""scikit-learn's bundled 8x8 handwritten digits (1797 images, no download)."""

import torch


class TensorPairs(torch.utils.data.Dataset):
    """(features, label) rows held in two tensors, with a batched fetch."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor):
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.features[index], self.labels[index]

    def __getitems__(self, indices: list[int]):
        index = torch.tensor(indices, dtype=torch.long)
        return self.features[index], self.labels[index]


def digits_datasets(eval_fraction: float = 0.2):
    from sklearn.datasets import load_digits

    digits = load_digits()
    features = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    # A fixed permutation (not the training seed) so the held-out set never changes between runs.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    cut = int(len(labels) * (1 - eval_fraction))
    train, held_out = order[:cut], order[cut:]
    return TensorPairs(features[train], labels[train]), TensorPairs(features[held_out], labels[held_out])
