"""torchvision's ResNet-18 for small images (the CIFAR adaptation of He et al. 2016, §4.2).

`torchvision.models.resnet18` as it is (BasicBlock, [2, 2, 2, 2], its forward and initialisation),
with a 3x3 stride-1 stem and no max-pool: on images of 16 to 32 pixels the ImageNet stem (7x7
stride 2, then a stride-2 max-pool) would leave a few pixels for the four stages. `width` scales
the stages' channels (width, 2w, 4w, 8w; torchvision's is 64), rebuilt with torchvision's own
`_make_layer`, so a CPU can train it in minutes and a test in seconds.

Plain PyTorch with no distributed code: its BatchNorm layers are torch's own, and synchronised
batch statistics are applied from outside like any strategy.
"""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

_DECLARED: list[torch.library.Library] = []
"""The stand-in operator library, kept alive: torch drops a Library's definitions with it."""


def _extension_loads() -> bool:
    """Whether torchvision's compiled operators (its `_C` extension) load beside this torch."""
    spec = importlib.util.find_spec("torchvision")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(folder, "_C" + suffix)
            if path.is_file():
                try:
                    torch.ops.load_library(str(path))
                    return True
                except OSError:
                    return False
    return False


def torchvision():
    """torchvision, importable beside torch's CPU wheel.

    torchvision's wheels on PyPI are CUDA builds: beside the CPU torch their `_C` extension (nms,
    roi_align, ...) cannot load, and torchvision's import then fails registering a fake kernel for
    an operator that was never defined ("operator torchvision::nms does not exist",
    pytorch/vision#9085). The models use none of those operators; where the extension does not
    load, the two the import touches unguarded are declared first (schemas only: calling them still
    fails, as it would without the extension)."""
    if "torchvision" not in sys.modules and not _DECLARED and not _extension_loads():
        library = torch.library.Library("torchvision", "DEF")
        for name in ("nms", "qnms"):
            library.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _DECLARED.append(library)
    import torchvision as found

    return found


def resnet18(classes: int, width: int = 64) -> nn.Module:
    """ResNet-18 for small images with `classes` outputs and stage widths width .. 8 x width."""
    resnet = torchvision().models.resnet
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
