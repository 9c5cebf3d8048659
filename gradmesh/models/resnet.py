"""torchvision's ResNet-18 for small images (the CIFAR adaptation of He et al. 2016, §4.2).

`torchvision.models.resnet18` as it is (BasicBlock, [2, 2, 2, 2], its forward and initialisation),
with a 3x3 stride-1 stem and no max-pool: on images of 16 to 32 pixels the ImageNet stem (7x7
stride 2, then a stride-2 max-pool) would leave a few pixels for the four stages. `width` scales
the stages' channels (width, 2w, 4w, 8w; torchvision's is 64), rebuilt with torchvision's own
`_make_layer`, so a CPU can train it in minutes and a test in seconds.

Plain PyTorch with no distributed code: its BatchNorm layers are torch's own, and synchronised
batch statistics are applied from outside like any strategy.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def resnet18(classes: int, width: int = 64) -> nn.Module:
    """ResNet-18 for small images with `classes` outputs and stage widths width .. 8 x width."""
    # Imported here, not at the top: torchvision's import (its datasets, transforms and PIL) is
    # slow, and only this workload's processes should pay for it. Importable beside the CPU
    # torch through gradmesh.torchvision_compat.
    from torchvision.models import resnet

    model = resnet.resnet18(num_classes=classes)
    model.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    if width != 64:
        model.bn1 = nn.BatchNorm2d(width)
        model.inplanes = width
        for stage in range(4):
            blocks = model._make_layer(resnet.BasicBlock, width * 2**stage, 2, stride=1 if stage == 0 else 2)
            setattr(model, f"layer{stage + 1}", blocks)
        model.fc = nn.Linear(8 * width, classes)
    for module in model.modules():  # torchvision's initialisation, for the layers made here
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return model


def sample_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction="none")


def per_sample_loss(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return sample_losses(model(images), labels)
