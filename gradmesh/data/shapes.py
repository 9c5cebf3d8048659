"""Coloured shapes for the vision workload (resnet): made at run time, deterministic, no download.

Each image is SIZE x SIZE RGB: a background of one random colour, one filled shape of another
(a circle, square, triangle, cross, diamond or ring) at a random position and size, wholly
inside the image, and independent uniform pixel noise. The label is the shape.

The ceiling is 100% by construction. The shape's colour differs from the background's by at
least CONTRAST in some channel and the noise moves a pixel by at most NOISE < CONTRAST / 2 (then
clipped to [0, 1], which keeps the order of values), so in that channel every shape pixel lies
nearer the shape's colour than the background's: the shape's exact pixel mask can be read back
from the image by a threshold in that channel (the tests check this of every image). And no
mask is drawn by two shapes: from the smallest size (MIN_RADIUS of the image side, at least 16
pixels) up, the masks one shape draws at any position and size are never masks another shape
draws (the tests check this over many thousands of draws), so the mask determines the label. A
model that reads the image perfectly is right on every held-out image: `accuracy_ceiling`, 1.0,
is reported beside the measured accuracy.

The images come from their own seed, not the training seed: every rank, run and strategy sees
the same images, and only the order in which they are drawn follows the training seed.
"""

from collections.abc import Callable

import torch

SHAPES = ("circle", "square", "triangle", "cross", "diamond", "ring")
SEED = 20_261_207
ACCURACY_CEILING = 1.0
"""Held-out accuracy a perfect reader of the images reaches (the module's docstring says why)."""
CONTRAST = 0.5
"""Least difference between shape and background colour, in the channel where they differ most."""
NOISE = 0.2
"""Each pixel channel moves by a uniform amount in [-NOISE, NOISE]."""
MIN_RADIUS = 0.2
"""Smallest half-size of a shape, as a fraction of the image side (the largest: MAX_RADIUS)."""
MAX_RADIUS = 0.4
EVAL_FRACTION = 0.1

Mask = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(dx, dy, r) -> pixels inside: offsets of each pixel from the centre, the half-size."""

MASKS: dict[str, Mask] = {
    "circle": lambda dx, dy, r: dx**2 + dy**2 <= r**2,
    "square": lambda dx, dy, r: torch.maximum(dx.abs(), dy.abs()) <= 0.8 * r,
    "triangle": lambda dx, dy, r: (dy.abs() <= r) & (dx.abs() <= (dy + r) / 2),  # apex up, base 2r wide
    "cross": lambda dx, dy, r: (torch.minimum(dx.abs(), dy.abs()) <= r / 3) & (torch.maximum(dx.abs(), dy.abs()) <= r),
    "diamond": lambda dx, dy, r: dx.abs() + dy.abs() <= r,
    "ring": lambda dx, dy, r: (dx**2 + dy**2 <= r**2) & (dx**2 + dy**2 >= (0.55 * r) ** 2),
}


class Images(torch.utils.data.Dataset):
    """(images [n, 3, size, size] float32, labels [n] int64), with a batched fetch. Held as bytes
    (a quarter of the memory) and turned into floats per fetch."""

    def __init__(self, pixels: torch.Tensor, labels: torch.Tensor, masks: torch.Tensor):
        self.pixels, self.labels = pixels, labels
        self.masks = masks
        """Each image's shape pixels [n, size, size] (bool), as drawn."""

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.pixels[index].float() / 255.0, self.labels[index]

    def __getitems__(self, indices: list[int]):
        index = torch.tensor(indices, dtype=torch.long)
        return self.pixels[index].float() / 255.0, self.labels[index]


def draw_masks(labels: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    n = len(labels)
    radius = size * (MIN_RADIUS + (MAX_RADIUS - MIN_RADIUS) * torch.rand(n, generator=generator))
    # centres keep the whole shape inside: r <= centre <= size - 1 - r (pixel centres at 0..size-1)
    low, span = radius, (size - 1 - 2 * radius).clamp(min=0)
    cx, cy = (low + span * torch.rand(n, generator=generator) for _ in range(2))
    grid = torch.arange(size, dtype=torch.float32)
    dx = grid.view(1, 1, size) - cx.view(n, 1, 1)
    dy = grid.view(1, size, 1) - cy.view(n, 1, 1)
    r = radius.view(n, 1, 1)
    mask = torch.zeros(n, size, size, dtype=torch.bool)
    for k, name in enumerate(SHAPES):
        mask |= MASKS[name](dx, dy, r) & (labels == k).view(n, 1, 1)
    return mask


def _colours(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(background, shape) colours [n, 3] in [0, 1]: uniform, except that in one channel, picked at
    random, the shape's lies at least CONTRAST from the background's (on whichever side has room)."""
    background = torch.rand(n, 3, generator=generator)
    shape = torch.rand(n, 3, generator=generator)
    channel = torch.randint(3, (n,), generator=generator)
    rows = torch.arange(n)
    base = background[rows, channel]
    room = torch.where(base <= 0.5, 1 - CONTRAST - base, base - CONTRAST)  # >= 0 either way
    step = CONTRAST + room * torch.rand(n, generator=generator)
    shape[rows, channel] = torch.where(base <= 0.5, base + step, base - step)
    return background, shape


CHUNK = 4096
"""Images made at a time: the float temporaries stay small whatever the number of samples."""


def _draw(count: int, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pixels [count, 3, size, size] uint8, labels [count], masks [count, size, size])."""
    labels = torch.randint(len(SHAPES), (count,), generator=generator)
    mask = draw_masks(labels, size, generator)
    background, shape = _colours(count, generator)
    colour = torch.where(mask.unsqueeze(1), shape.view(-1, 3, 1, 1), background.view(-1, 3, 1, 1))
    colour += (2 * torch.rand(colour.shape, generator=generator) - 1) * NOISE
    return colour.mul_(255.0).round_().clamp_(0, 255).to(torch.uint8), labels, mask


def generate(samples: int, size: int) -> tuple[Images, Images]:
    """(training split, held-out split) of `samples` images of `size` x `size` pixels."""
    generator = torch.Generator().manual_seed(SEED)
    parts = [_draw(min(CHUNK, samples - start), size, generator) for start in range(0, samples, CHUNK)]
    pixels, labels, mask = (torch.cat(part) for part in zip(*parts))
    cut = samples - max(1, int(samples * EVAL_FRACTION))
    train, held_out = slice(0, cut), slice(cut, samples)
    return (
        Images(pixels[train].contiguous(), labels[train].contiguous(), mask[train].contiguous()),
        Images(pixels[held_out].contiguous(), labels[held_out].contiguous(), mask[held_out].contiguous()),
    )


def data_bytes(samples: int, size: int) -> int:
    """Host memory the images take: bytes of pixels, a mask and a label per image."""
    return samples * (4 * size * size + 8)
