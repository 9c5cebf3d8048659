"""Data: the global-order sampler and the built-in corpora and datasets."""

from gradmesh.data.sampler import GlobalBatch, GlobalOrderSampler, split_evenly

__all__ = ["GlobalBatch", "GlobalOrderSampler", "fetch", "split_evenly"]


def fetch(dataset, indices: list[int]):
    """Collate the given samples, through the dataset's batched `__getitems__` when it has one."""
    import torch.utils.data

    batched = getattr(dataset, "__getitems__", None)
    if batched is not None:
        items = batched(indices)
        # torch's convention is a list of samples; ours return ready-made batch tensors.
        return torch.utils.data.default_collate(items) if isinstance(items, list) else items
    return torch.utils.data.default_collate([dataset[i] for i in indices])
