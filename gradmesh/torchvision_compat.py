"""torchvision importable beside torch's CPU wheel: a known hack (pytorch/vision#9085).

torchvision's wheels on PyPI are CUDA builds. Beside the CPU torch gradmesh pins, their compiled
operators (`torchvision._C`: nms, roi_align, ...) cannot load, and torchvision's import then
fails outright: it registers a fake kernel for `torchvision::nms` unguarded, and that operator
was never defined ("operator torchvision::nms does not exist"). Whoever imports torchvision
fails with it: gradmesh's resnet workload, and transformers, whose model code imports it for
its image utilities wherever it is installed (so the hf:* models too).

Nothing gradmesh runs calls those operators. So the first time a gradmesh process imports
torchvision, this module checks whether the extension loads and, where it does not, declares the
two operators the import touches unguarded (schemas only: calling them still fails, as it would
without the extension). Where the extension loads (a torchvision built for this torch), it does
nothing. `install` puts a finder on `sys.meta_path` for that and imports nothing itself, so
`import gradmesh` (which installs it) still costs no torch import.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

_DECLARED: list = []
"""The stand-in operator library, kept alive: torch drops a Library's definitions with it."""


def _extension_loads() -> bool:
    import torch

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


def make_importable() -> None:
    """Declare the operators torchvision's import needs where its extension cannot load."""
    if _DECLARED or "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return
    if not _extension_loads():
        import torch

        library = torch.library.Library("torchvision", "DEF")
        for name in ("nms", "qnms"):
            library.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _DECLARED.append(library)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs `make_importable` once, as torchvision is first imported; finds nothing itself."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            make_importable()
        return None


def install() -> None:
    if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
