"""The optimizer state of the servers' shards, to and from parameter names.

A server runs torch's own optimizer over its shard as one flat parameter, so its state is one
flat tensor per element-wise slot (Adam's two moments, SGD's momentum) and a scalar or two
(Adam's step count). Checkpoints hold the state the way data parallelism's optimizer holds it,
per parameter name, so any strategy reads what a parameter server wrote and the other way round.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from gradmesh.optim import probe_state
from gradmesh.parallel.ps import Layout


def slot_bytes(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> int:
    """Bytes of the optimizer state `optimizer` holds for `param` (none before its first step)."""
    state = optimizer.state.get(param, {})
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


class OptimizerSlots:
    def __init__(self, optimizer_class: type, kwargs: dict):
        self.elementwise, self.scalars = probe_state(optimizer_class, kwargs)

    def template(self, named: list[tuple[str, nn.Parameter]]) -> dict:
        """Zeros shaped as the state of these parameters to be loaded (DCP loads into given tensors)."""
        return {
            "state": {
                name: {
                    **{k: torch.zeros_like(p) for k in self.elementwise},
                    **{k: torch.zeros_like(v) for k, v in self.scalars.items()},
                }
                for name, p in named
            }
        }

    def gather(self, mine: dict | None, pieces: list[tuple[int, int, int]], wire, flat: torch.Tensor) -> dict:
        """Collective: every slot of the whole flat vector, on every rank ({} before the first update).

        `pieces`: (rank, low, high) of each holder of a range (servers, or under the hybrid
        strategy the first worker for all); `mine`: this rank's state if it holds one."""
        first = pieces[0][0]
        stepped = torch.tensor([int(bool(mine))])
        dist.broadcast(stepped, src=first, group=wire.header_group)
        if not stepped.item():
            return {}
        me = dist.get_rank()
        held = mine or {}  # a holder of a range holds state once the first holder has stepped
        found = {}
        for key in self.elementwise:
            whole = torch.zeros_like(flat)
            for rank, low, high in pieces:
                if rank == me:
                    whole[low:high] = held[key]
                dist.broadcast(whole[low:high], src=rank, group=wire.payload_group)
            found[key] = whole
        for key, like in self.scalars.items():
            value = mine[key].detach().cpu().clone() if mine else torch.zeros_like(like)
            dist.broadcast(value, src=first, group=wire.header_group)
            found[key] = value
        return found

    def named(self, slots: dict, names: list[str], layout: Layout) -> dict:
        if not slots:
            return {"state": {}}
        state = {}
        for index, name in enumerate(names):
            low, high, shape = layout.offsets[index], layout.offsets[index + 1], layout.shapes[index]
            state[name] = {key: slots[key][low:high].view(shape) for key in self.elementwise}
            state[name].update({key: slots[key].clone() for key in self.scalars})
        return {"state": state}

    def shard_of(self, state: dict, names: list[str], shard: tuple[int, int]) -> dict:
        """The flat state of one server's shard from state loaded under parameter names."""
        if not state or not all(name in state for name in names):
            return {}
        low, high = shard
        found = {
            key: torch.cat([state[name][key].reshape(-1) for name in names])[low:high].clone()
            for key in self.elementwise
        }
        found.update({key: state[names[0]][key].clone() for key in self.scalars})
        return found
