"""A vision model in your own loop: torchvision's ResNet-18 (small-image stem) learning which
shape a generated image shows, with synchronised BatchNorm, trained with gradmesh.Loop.

    gradmesh run --nproc 2 examples/resnet_shapes.py --run-dir runs/resnet-own
    python examples/resnet_shapes.py --run-dir runs/resnet-own-1      # one process, the same model

The images (six coloured shapes at random positions, sizes and colours, with noise) are drawn
at start-up from a fixed seed: nothing is downloaded. BatchNorm layers become gradmesh's
synchronised ones (torch's SyncBatchNorm refuses CPU tensors), so every rank normalises with the
statistics of the whole global batch, as one process would.
"""

import argparse

import torch
import torch.nn.functional as F

import gradmesh
from gradmesh.data import shapes
from gradmesh.models.resnet import resnet18
from gradmesh.parallel.batchnorm import convert_sync_batchnorm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/resnet-own")
    parser.add_argument("--strategy", default="ddp", help="ddp, zero1 or fsdp")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=24_000)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage (torchvision's: 64)")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    args = parser.parse_args()

    gm = gradmesh.Loop(strategy=args.strategy, run_dir=args.run_dir, seed=0)
    train, held_out = shapes.generate(args.samples, args.image_size)
    model = convert_sync_batchnorm(resnet18(len(shapes.SHAPES), args.width))
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    model, optimizer = gm.prepare(model, optimizer)
    for _step, (images, labels) in gm.batches(train, args.global_batch_size, args.steps):
        logits = model(images)
        gm.backward(F.cross_entropy(logits, labels))
        gm.step(optimizer)
        gm.log(batch_accuracy=(logits.argmax(1) == labels).float().mean())
    model.eval()
    correct = 0
    with torch.no_grad():  # every rank evaluates the same held-out images (BatchNorm in eval mode)
        for start in range(0, len(held_out), 500):
            images, labels = held_out[start : start + 500]
            correct += (model(images.to(gm.device)).argmax(1).cpu() == labels).sum().item()
    accuracy = correct / len(held_out)
    summary = gm.close()
    if gm.rank == 0:
        print(f"held-out accuracy {accuracy:.4f} (ceiling {shapes.ACCURACY_CEILING:.2f}), "
              f"final loss {summary['final_loss']:.4f} after {summary['samples']} samples")


if __name__ == "__main__":
    main()
