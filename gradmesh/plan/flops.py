"""What one worker's computation would cost on a device this machine does not have: the model's
arithmetic, counted, over the device's peak times its efficiency (`gradmesh.plan.hardware`).

Nothing runs for real. The configured model is built on the meta device (shapes, no memory) and
one forward and backward pass of a meta batch goes through torch's `FlopCounterMode`, which
counts the FLOPs of the matrix products, convolutions and attention from their shapes (the
arithmetic a GPU's tensor cores do; element-wise work is left out, as in the usual 6 x params x
tokens accounting). The bytes autograd saves for backward are counted on the same pass by a
saved-tensor hook (each tensor once, parameters excluded: what the memory guard's meter counts
on real storage, which meta tensors lack). The optimizer's step and a server's summing are
memory-bound: bytes each parameter's update reads and writes over the device's memory bandwidth.
"""

from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from gradmesh.config import Config
from gradmesh.plan.compute import ComputeProfile, unit_boundaries
from gradmesh.plan.hardware import Device

FP32 = 4
CONTEXT_BYTES = 2**30
"""A GPU process's memory beside model state and activations (the CUDA context, cuDNN/cuBLAS
workspaces, the caching allocator's slack): an allowance, not a figure from any device."""


def meta_batch(cfg: Config, samples: int) -> tuple[torch.Tensor, ...]:
    """A batch of `samples` in the configured workload's input format, on the meta device."""
    from gradmesh.config.workload import TEXT_MODELS
    from gradmesh.data import clicks

    with torch.device("meta"):
        if cfg.model.name in TEXT_MODELS:
            tokens = torch.zeros(samples, cfg.model.block_size, dtype=torch.long)
            return tokens, tokens.clone()
        if cfg.model.name == "resnet":
            side = cfg.model.image_size
            return torch.zeros(samples, 3, side, side), torch.zeros(samples, dtype=torch.long)
        if cfg.model.name == "recsys":
            ids = torch.zeros(samples, cfg.model.tables, dtype=torch.long)
            return torch.zeros(samples, clicks.DENSE), ids, torch.zeros(samples)
        return torch.zeros(samples, 64), torch.zeros(samples, dtype=torch.long)


def loss_function(cfg: Config):
    from gradmesh import hf
    from gradmesh.config.workload import HF_MODELS
    from gradmesh.models import dlrm, gpt, mlp, resnet

    losses = {
        "gpt-char": gpt.per_sample_loss,
        "recsys": dlrm.per_sample_loss,
        "resnet": resnet.per_sample_loss,
        **dict.fromkeys(HF_MODELS, hf.per_sample_loss),
    }
    return losses.get(cfg.model.name, mlp.per_sample_loss)


def _pass(model, loss_fn, batch) -> tuple[float, float]:
    """(FLOPs, bytes saved for backward) of one forward and backward pass."""
    parameters = {id(p) for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}  # kept alive so that no id is reused within the pass

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in parameters:
            saved[id(base)] = base
        return tensor

    counter = FlopCounterMode(display=False)
    with counter:
        # Fake tensors over the meta ones: code that looks at a tensor's values (transformers' mask
        # code asks whether the positions hold packed sequences) takes its tracing path, not .item().
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
            FakeTensorMode(allow_non_fake_inputs=True),
        ):
            loss = loss_fn(model, batch).mean()
        loss.backward()
    return float(counter.get_total_flops()), float(sum(t.numel() * t.element_size() for t in saved.values()))


def update_s_per_param(device: Device, slots: int) -> float:
    """An optimizer's step per parameter, memory-bound: it reads the parameter, its gradient and
    each slot, and writes the parameter and each slot (fp32)."""
    return FP32 * (3 + 2 * slots) / device.memory_bandwidth


def flop_profile(cfg: Config, device: Device, samples: int = 8) -> ComputeProfile:
    """The configured model's compute on one `device` at fp32 (what gradmesh trains in)."""
    from gradmesh import workloads
    from gradmesh.optim import optimizer_slots, optimizer_spec

    model, loss_fn = workloads.meta_model(cfg), loss_function(cfg)
    flops, saved = _pass(model, loss_fn, meta_batch(cfg, samples))
    boundary, layers = unit_boundaries(SimpleNamespace(model=model, loss_fn=loss_fn), meta_batch(cfg, samples))
    slots = optimizer_slots(*optimizer_spec(cfg.train))
    return ComputeProfile(
        threads=1,
        fixed_s=0.0,
        per_sample_s=flops / samples / (device.peak_fp32 * device.efficiency),
        optimizer_s_per_param=update_s_per_param(device, slots),
        add_s_per_param=FP32 * 3 / device.memory_bandwidth,  # two read, one written
        activation_bytes_per_sample=saved / samples,
        params=sum(p.numel() for p in model.parameters()),
        base_bytes=CONTEXT_BYTES,
        boundary_bytes_per_sample=boundary,
        layers=layers,
    )
