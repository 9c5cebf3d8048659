"""Plain PyTorch models. Nothing here imports gradmesh or torch.distributed."""
