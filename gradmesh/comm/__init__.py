"""Communication: DDP comm hooks (the gradient all-reduce gradmesh can watch and guard)."""
