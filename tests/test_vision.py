"""The vision workload (resnet): torchvision's ResNet-18 on generated coloured shapes.

Parity (contract 2) with synchronised batch norm: 2 ranks under ddp and fsdp, and with one rank
that only pads (its share is empty at every step), train the model 1 process does, within 1e-5
relative L2 after 20 steps, parameters and BatchNorm's running statistics alike (both are in
model.safetensors). Measured: 2e-8 to 7e-8 under sgd and adamw; without synchronisation 1e-2.

The tiny model (width 8, 16-pixel images) keeps each run to seconds, and its 360 training images
give no short batch within 20 steps: BatchNorm over a batch of a few images is so ill-conditioned
that rounding alone, in one process, moves the weights past 1e-5 (docs/getting-started.md#resnet-shapes).
"""

import json

import numpy as np
import pytest
import torch
from helpers import rel_l2, summary, weights
from runs import References

TOLERANCE = 1e-5
TINY_RESNET = ("--model", "resnet", "--set", "model.width=8", "--set", "model.samples=400")
STEPS = ("--max-steps", "20", "--global-batch-size", "16")
PADS = ("--balance", "static:31,1", "--record-samples")
"""Shares of 16 split 31:1 are 16 and 0: rank 1 runs one stand-in sample at weight 0 every step."""
# A short run that learns: 80 steps of 128 on 3,600 training images (chance: 1 in 6; measured 0.76).
LEARNS = ("--model", "resnet", "--set", "model.width=16", "--set", "model.samples=4000", "--max-steps", "80",
          "--global-batch-size", "128", "--lr", "0.008", "--set", "train.decay_steps=80",
          "--set", "train.warmup_steps=10")


def vision_run(catalogue, nproc: int, optimizer: str, *extra: str):
    return catalogue.run(nproc, *TINY_RESNET, *STEPS, "--optimizer", optimizer, *extra, tiny=False)


@pytest.fixture(scope="module")
def reference(catalogue):
    """Single-process runs, one per optimizer: the yardstick."""
    return References(lambda optimizer: vision_run(catalogue, 1, optimizer))


@pytest.mark.parametrize("optimizer, extra", [
    ("sgd", ("--strategy", "ddp")), ("adamw", ("--strategy", "ddp")), ("sgd", ("--strategy", "fsdp")), ("sgd", PADS)],
    ids=["ddp sgd", "ddp adamw", "fsdp sgd", "a rank that only pads"])
def test_two_ranks_train_what_one_process_does(reference, catalogue, optimizer, extra):
    run = vision_run(catalogue, 2, optimizer, *extra)
    found = weights(run)
    assert any(".running_var" in name for name in found)  # the running statistics are compared too
    assert rel_l2(found, reference[optimizer]) <= TOLERANCE
    if extra == PADS:
        records = [json.loads(line) for line in (run / "samples-rank1.jsonl").read_text().splitlines()]
        assert len(records) == 20 and not any(record["indices"] for record in records)


def test_without_synchronised_batch_norm_two_ranks_train_another_model(reference, catalogue):
    """The yardstick can fail: each rank normalising by its own share is far outside the tolerance."""
    unsynced = weights(vision_run(catalogue, 2, "sgd", "--set", "model.sync_bn=false"))
    assert rel_l2(unsynced, reference["sgd"]) > 100 * TOLERANCE


@pytest.mark.slow  # 80 steps of a width-16 ResNet: the fast tier keeps the parity runs
def test_resnet_learns_the_shapes(catalogue):
    info = summary(catalogue.run(2, *LEARNS, tiny=False))
    assert info["eval"]["accuracy_ceiling"] == 1.0
    assert info["eval"]["accuracy"] >= 0.5, info["eval"]  # chance is 1/6


def test_the_model_is_torchvisions_resnet18_with_a_small_image_stem():
    import torchvision

    from gradmesh.models.resnet import resnet18

    model, original = resnet18(6), torchvision.models.resnet18(num_classes=6)
    assert type(model) is type(original)
    assert {k: v.shape for k, v in model.state_dict().items() if k != "conv1.weight"} == {
        k: v.shape for k, v in original.state_dict().items() if k != "conv1.weight"}
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    narrow = resnet18(6, width=8)
    assert narrow.layer4[1].conv2.out_channels == 64 and narrow.fc.in_features == 64
    assert narrow(torch.rand(2, 3, 16, 16)).shape == (2, 6)


def _extremes(pixels: torch.Tensor, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image and channel, the least and the greatest of the pixels `where` picks."""
    high, low = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    return torch.where(where, pixels, high).amin((2, 3)), torch.where(where, pixels, low).amax((2, 3))


def test_images_are_deterministic_and_every_shape_can_be_read_back():
    """The ceiling's argument, checked: in some channel a threshold separates each image's shape
    pixels from its background pixels (the noise never crosses over), so the image gives its mask."""
    from gradmesh.data import shapes

    train, held_out = shapes.generate(3000, 16)
    again, _ = shapes.generate(3000, 16)
    assert torch.equal(train.pixels, again.pixels) and torch.equal(train.labels, again.labels)
    assert len(train) == 2700 and len(held_out) == 300 and set(train.labels.tolist()) == set(range(6))
    for images in (train, held_out):
        pixels, inside = images.pixels.float(), images.masks.unsqueeze(1)
        (shape_min, shape_max), (ground_min, ground_max) = _extremes(pixels, inside), _extremes(pixels, ~inside)
        assert ((shape_min > ground_max) | (shape_max < ground_min)).any(dim=1).all()


@pytest.mark.parametrize("size", [16, 24])
def test_no_mask_is_drawn_by_two_shapes(size):
    """The other half of the ceiling: many thousands of random positions and sizes, and no pixel
    mask that one shape draws is ever drawn by another."""
    from gradmesh.data import shapes

    labels = torch.arange(60_000) % len(shapes.SHAPES)
    masks = shapes.draw_masks(labels, size, torch.Generator().manual_seed(1)).flatten(1).numpy()
    packed = np.packbits(masks, axis=1)
    _, which = np.unique(packed, axis=0, return_inverse=True)
    owners = {}
    for mask, label in zip(which.ravel().tolist(), labels.tolist()):
        assert owners.setdefault(mask, label) == label, f"a {shapes.SHAPES[label]} drew a {shapes.SHAPES[owners[mask]]}"
