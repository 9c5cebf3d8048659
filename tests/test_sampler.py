import itertools

import pytest

from gradmesh.data import GlobalOrderSampler, split_evenly


def steps(sampler, count, rank, world, accum):
    return [sampler.next_batch(rank, world, accum) for _ in range(count)]


def union_of_shares(n, batch, count, world, accum, seed=0):
    """Per step, the indices all ranks consumed together, in rank and micro-batch order."""
    per_rank = [steps(GlobalOrderSampler(n, batch, seed), count, r, world, accum) for r in range(world)]
    return [[i for r in range(world) for m in per_rank[r][s].micro_batches for i in m] for s in range(count)]


@pytest.mark.parametrize("world, accum", [(2, 1), (4, 1), (2, 3), (3, 2)])
def test_global_batches_do_not_depend_on_world_size_or_micro_batches(world, accum):
    single = union_of_shares(103, 12, 30, 1, 1)
    assert union_of_shares(103, 12, 30, world, accum) == single


def test_every_sample_used_exactly_once_per_epoch_including_a_short_last_batch():
    sampler = GlobalOrderSampler(103, 12, seed=5)
    assert sampler.batches_per_epoch == 9
    for epoch in range(2):
        seen = [i for b in steps(sampler, 9, 0, 1, 1) for i in b.indices]
        assert sorted(seen) == list(range(103)), f"epoch {epoch}"
    assert sampler.epoch == 2 and sampler.batch_in_epoch == 0


def test_epochs_are_reshuffled_and_seeds_differ():
    a = GlobalOrderSampler(50, 10, seed=0)
    assert a.epoch_order(0) != a.epoch_order(1)
    assert a.epoch_order(0) != GlobalOrderSampler(50, 10, seed=1).epoch_order(0)


def test_resume_from_state_continues_the_same_sequence():
    whole = [b.indices for b in steps(GlobalOrderSampler(103, 12, 3), 25, 0, 1, 1)]
    first = GlobalOrderSampler(103, 12, 3)
    head = [b.indices for b in steps(first, 11, 0, 1, 1)]
    second = GlobalOrderSampler(103, 12, 3)
    second.load_state_dict(first.state_dict())
    tail = [b.indices for b in steps(second, 14, 0, 1, 1)]
    assert head + tail == whole


def test_state_from_another_dataset_is_refused():
    state = GlobalOrderSampler(100, 10).state_dict()
    with pytest.raises(ValueError, match="global_batch_size"):
        GlobalOrderSampler(100, 20).load_state_dict(state)


def test_short_batch_can_leave_a_rank_with_nothing():
    sampler = GlobalOrderSampler(9, 8)
    sampler.next_batch(0, 4, 1)
    last = sampler.next_batch(3, 4, 1)  # one sample left for four ranks
    assert last.size == 1 and last.micro_batches == [[]]


@pytest.mark.parametrize("n, parts", list(itertools.product(range(0, 12), range(1, 5))))
def test_split_evenly(n, parts):
    pieces = split_evenly(list(range(n)), parts)
    assert [i for p in pieces for i in p] == list(range(n))
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


def test_the_largest_accepted_seed_gives_an_order():
    """Config accepts seeds up to 2^63 - 1; the per-epoch generator seed derived from it must fit too."""
    sampler = GlobalOrderSampler(10, 4, seed=2**63 - 1)
    assert sorted(i for _ in range(3) for i in sampler.next_batch(0, 1, 1).indices) == list(range(10))


def test_the_state_before_the_newest_batch_draws_that_batch_again_across_an_epoch_end():
    """In-place recovery hands a newcomer this state while the members redo a failed step."""
    from gradmesh.data.sampler import GlobalOrderSampler

    sampler = GlobalOrderSampler(dataset_len=50, global_batch_size=16, seed=3)
    for _ in range(3):
        batch = sampler.next_global()  # the third is the last of epoch 0 (3 batches of 16 in 50)
        again = GlobalOrderSampler(dataset_len=50, global_batch_size=16, seed=3)
        again.load_state_dict(sampler.state_before(batch))
        assert again.next_global().indices == batch.indices and again.state_dict() == sampler.state_dict()
