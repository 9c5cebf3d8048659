"""Replica consistency: data-parallel replicas compare a checksum of every parameter.

Every rank computes a CRC-32 of each parameter's bytes (zlib's, over the tensor as stored);
one all_gather of the checksums (a few bytes per tensor) on the monitoring group compares them.
Bit-identical replicas are what DDP promises — the same averaged gradient applied to the same
weights — so any difference is a real divergence (a bad reduction, a rank that skipped a step,
a silent memory error), and the first differing tensor is named.
"""

import zlib

import torch
import torch.distributed as dist
import torch.nn as nn


def checksums(model: nn.Module) -> tuple[list[str], torch.Tensor]:
    names, sums = [], []
    for name, param in model.named_parameters():
        data = param.detach().contiguous().cpu()
        names.append(name)
        sums.append(zlib.crc32(data.view(torch.uint8).numpy().tobytes()) if data.numel() else 0)
    return names, torch.tensor(sums, dtype=torch.int64)


def compare_replicas(model: nn.Module, group, world_size: int) -> dict | None:
    """Collective over `group` (every data-parallel replica); None when all agree, else the first
    differing tensor and which ranks hold which checksum."""
    names, local = checksums(model)
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=group)
    table = torch.stack(gathered)
    differs = (table != table[0]).any(dim=0)
    if not differs.any():
        return None
    index = int(differs.nonzero()[0])
    column = table[:, index].tolist()
    # The reference: the checksum most ranks hold, or rank 0's where no value has a strict
    # majority (with two replicas there is no telling which one moved; rank 0's is DDP's source).
    majority = max(set(column), key=column.count)
    reference = majority if column.count(majority) * 2 > len(column) else column[0]
    odd = [rank for rank, value in enumerate(column) if value != reference]
    return {"tensor": names[index], "ranks": odd, "differing_tensors": int(differs.sum())}
