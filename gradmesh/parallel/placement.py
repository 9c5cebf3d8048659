"""Table-wise placement (`--table-sharding table`): which rank holds each sparse table whole. Kept
apart from the strategy (no torch), so that the registry's memory formula reads it too."""


def greedy_owners(sizes: list[int], ranks: int) -> list[int]:
    """Each table's rank: the largest table first, each to the rank holding the least so far
    (ties: the lower table first, the lower rank). Reads only the sizes: the same on every rank."""
    held, owners = [0] * ranks, [0] * len(sizes)
    for table in sorted(range(len(sizes)), key=lambda t: (-sizes[t], t)):
        owner = min(range(ranks), key=lambda r: (held[r], r))
        owners[table], held[owner] = owner, held[owner] + sizes[table]
    return owners


def largest_share(sizes: list[int], ranks: int) -> int:
    """What the rank holding the most holds under `greedy_owners`."""
    held = [0] * ranks
    for size, owner in zip(sizes, greedy_owners(sizes, ranks)):
        held[owner] += size
    return max(held)


def whole_tables(cfg, tables: list) -> tuple[int, ...]:
    """`ModelSize.whole_tables` of a job's sparse tables (nn.Embedding): their sizes where
    --table-sharding places each whole on one rank, else none."""
    return tuple(table.weight.numel() for table in tables) if cfg.train.table_sharding == "table" else ()
