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


def bundled_digits():
    """(data, target) as `sklearn.datasets.load_digits` returns them, read from the file
    scikit-learn ships (digits.csv.gz: 64 pixel columns, then the label) without importing
    scikit-learn, which imports SciPy: most of a second of every worker's start. Where the file
    is not in its place (another scikit-learn layout), scikit-learn's own loader."""
    import gzip
    import importlib.util
    from pathlib import Path

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    where = list(spec.submodule_search_locations or []) if spec else []
    path = Path(where[0], "datasets", "data", "digits.csv.gz") if where else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.data, digits.target
    with gzip.open(path, "rt") as text:
        table = np.loadtxt(text, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def digits_datasets(eval_fraction: float = 0.2):
    data, target = bundled_digits()
    features = torch.tensor(data, dtype=torch.float32) / 16.0
    labels = torch.tensor(target, dtype=torch.long)
    # A fixed permutation (not the training seed) so the held-out set never changes between runs.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    cut = int(len(labels) * (1 - eval_fraction))
    train, held_out = order[:cut], order[cut:]
    return TensorPairs(features[train], labels[train]), TensorPairs(features[held_out], labels[held_out])
