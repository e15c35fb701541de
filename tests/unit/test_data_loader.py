"""The deterministic distributed sampler: same samples for every world size, resume and prefetch."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from meshforge.data.loader import (
    DistributedBatchLoader,
    StepBatch,
    global_batch_offsets,
    rank_micro_batches,
    val_batches,
    val_offsets,
)
from meshforge.data.shards import ShardedTokens
from meshforge.errors import ConfigError, DataError

SEQ_LEN = 16
TOKENS = np.random.default_rng(0).integers(0, 256, size=5_000).astype(np.uint16)


def _rows(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """All sequences of a rank's step, micro-batches concatenated in order."""
    return (
        torch.cat([x for x, _ in batch.micro_batches]),
        torch.cat([y for _, y in batch.micro_batches]),
    )


def _loader(**overrides) -> DistributedBatchLoader:  # type: ignore[no-untyped-def]
    kwargs = dict(
        tokens=TOKENS,
        seq_len=SEQ_LEN,
        global_batch=8,
        micro_batch=2,
        dp_rank=0,
        dp_size=1,
        seed=1234,
        start_step=0,
        prefetch=0,
    )
    kwargs.update(overrides)
    return DistributedBatchLoader(**kwargs)


def test_global_batch_offsets_depend_only_on_seed_and_step() -> None:
    a = global_batch_offsets(7, 3, len(TOKENS), SEQ_LEN, 32)
    b = global_batch_offsets(7, 3, len(TOKENS), SEQ_LEN, 32)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int64 and a.shape == (32,)
    assert not np.array_equal(a, global_batch_offsets(7, 4, len(TOKENS), SEQ_LEN, 32))
    assert not np.array_equal(a, global_batch_offsets(8, 3, len(TOKENS), SEQ_LEN, 32))
    assert a.min() >= 0 and a.max() <= len(TOKENS) - SEQ_LEN - 1


def test_offsets_reach_both_ends_of_a_tiny_token_array() -> None:
    offsets = global_batch_offsets(0, 0, SEQ_LEN + 2, SEQ_LEN, 200)
    assert set(offsets.tolist()) == {0, 1}


def test_sequences_are_the_offsets_windows_shifted_by_one() -> None:
    batch = next(_loader())
    x, y = _rows(batch)
    offsets = global_batch_offsets(1234, 0, len(TOKENS), SEQ_LEN, 8)
    for i, o in enumerate(offsets):
        np.testing.assert_array_equal(x[i].numpy(), TOKENS[o : o + SEQ_LEN])
        np.testing.assert_array_equal(y[i].numpy(), TOKENS[o + 1 : o + SEQ_LEN + 1])
    assert x.dtype == torch.int64 and x.shape == (8, SEQ_LEN)
    assert [mb[0].shape for mb in batch.micro_batches] == [(2, SEQ_LEN)] * 4
    assert all(mb[0].is_contiguous() and mb[1].is_contiguous() for mb in batch.micro_batches)


@pytest.mark.parametrize(("dp_size", "micro_batch"), [(2, 2), (2, 4), (4, 1), (8, 1)])
def test_ranks_slices_concatenate_to_the_world_1_global_batch(
    dp_size: int, micro_batch: int
) -> None:
    with _loader(micro_batch=8) as single:
        whole = [_rows(next(single)) for _ in range(4)]
    loaders = [_loader(dp_rank=r, dp_size=dp_size, micro_batch=micro_batch) for r in range(dp_size)]
    for step in range(4):
        per_rank = [next(loader) for loader in loaders]
        assert all(b.step == step for b in per_rank)
        assert all(len(b.micro_batches) == 8 // dp_size // micro_batch for b in per_rank)
        x = torch.cat([_rows(b)[0] for b in per_rank])
        y = torch.cat([_rows(b)[1] for b in per_rank])
        assert torch.equal(x, whole[step][0]) and torch.equal(y, whole[step][1])


def test_starting_at_step_k_equals_iterating_from_zero() -> None:
    with _loader(dp_rank=1, dp_size=2) as from_zero:
        batches = [next(from_zero) for _ in range(6)]
    with _loader(dp_rank=1, dp_size=2, start_step=4) as resumed:
        assert resumed.next_step == 4
        for expected in batches[4:]:
            got = next(resumed)
            assert got.step == expected.step
            assert all(
                torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                for a, b in zip(got.micro_batches, expected.micro_batches, strict=True)
            )


@pytest.mark.parametrize("prefetch", [1, 3])
def test_prefetching_gives_the_same_batches(prefetch: int) -> None:
    with _loader(prefetch=0, start_step=2) as plain, _loader(prefetch=prefetch, start_step=2) as bg:
        for _ in range(10):
            a, b = next(plain), next(bg)
            assert a.step == b.step
            assert torch.equal(_rows(a)[0], _rows(b)[0]) and torch.equal(_rows(a)[1], _rows(b)[1])
        assert bg.next_step == 12


def test_the_loader_reads_sharded_tokens_like_one_array() -> None:
    parts = np.split(TOKENS, [7, 1000, 1001, 3333])
    with _loader() as flat, _loader(tokens=ShardedTokens(parts)) as sharded:
        for _ in range(5):
            assert torch.equal(_rows(next(flat))[0], _rows(next(sharded))[0])


def test_data_wait_time_is_measured() -> None:
    with _loader(prefetch=2) as loader:
        next(loader)
        first = loader.last_wait_s
        next(loader)
        assert first >= 0 and loader.last_wait_s >= 0
        assert loader.total_wait_s == pytest.approx(first + loader.last_wait_s)


class _ExplodingTokens:
    """Token array that fails on the third read, to test error propagation from the thread."""

    def __init__(self) -> None:
        self.reads = 0

    def __len__(self) -> int:
        return len(TOKENS)

    def __getitem__(self, key: slice) -> np.ndarray:
        self.reads += 1
        if self.reads > 16:
            raise OSError("disk went away")
        return TOKENS[key]


def test_an_error_in_the_prefetch_thread_is_raised_in_the_consumer() -> None:
    loader = _loader(tokens=_ExplodingTokens(), prefetch=2)
    next(loader)
    next(loader)
    with pytest.raises(OSError, match="disk went away"):
        next(loader)
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)
    assert loader._thread is not None and not loader._thread.is_alive()


def test_close_stops_a_producer_blocked_on_a_full_queue() -> None:
    loader = _loader(prefetch=1)
    next(loader)
    loader.close()
    loader.close()  # idempotent
    assert loader._thread is not None and not loader._thread.is_alive()
    assert not any(t.name.startswith("meshforge-data") for t in threading.enumerate())


def test_indivisible_batches_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="train.global_batch=8 is not divisible by dp=3"):
        _loader(dp_size=3)
    with pytest.raises(ConfigError, match="train.micro_batch=3"):
        _loader(micro_batch=3)


def test_too_few_tokens_for_one_sequence_names_seq_len() -> None:
    with pytest.raises(DataError, match=r"model.seq_len \+ 1 = 17"):
        _loader(tokens=TOKENS[:16])


def test_rank_micro_batches_is_the_loaders_pure_function() -> None:
    pure = rank_micro_batches(
        TOKENS,
        seq_len=SEQ_LEN,
        global_batch=8,
        micro_batch=2,
        dp_rank=1,
        dp_size=2,
        seed=1234,
        step=5,
    )
    with _loader(dp_rank=1, dp_size=2, start_step=5) as loader:
        got = next(loader).micro_batches
    assert all(torch.equal(a[0], b[0]) for a, b in zip(pure, got, strict=True))


def test_val_batches_are_fixed_and_sliced_per_rank() -> None:
    val = TOKENS[:2000]
    whole = val_batches(val, SEQ_LEN, batch_size=4, n_batches=5, seed=3)
    again = val_batches(val, SEQ_LEN, batch_size=4, n_batches=5, seed=3)
    assert len(whole) == 5 and whole[0][0].shape == (4, SEQ_LEN)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole, again, strict=True))

    offsets = val_offsets(len(val), SEQ_LEN, batch_size=4, n_batches=5, seed=3)
    for (x, y), batch in zip(whole, offsets, strict=True):
        for row, o in enumerate(batch):
            np.testing.assert_array_equal(x[row].numpy(), val[o : o + SEQ_LEN])
            np.testing.assert_array_equal(y[row].numpy(), val[o + 1 : o + SEQ_LEN + 1])

    ranks = [val_batches(val, SEQ_LEN, 4, 5, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for b in range(5):
        assert torch.equal(torch.cat([ranks[0][b][0], ranks[1][b][0]]), whole[b][0])
        assert torch.equal(torch.cat([ranks[0][b][1], ranks[1][b][1]]), whole[b][1])


def test_val_offsets_cover_the_whole_split_one_per_stratum() -> None:
    n, batch_size, n_batches = 2000, 4, 5
    offsets = val_offsets(n, SEQ_LEN, batch_size, n_batches, seed=3)
    flat = np.sort(offsets.ravel())
    edges = np.linspace(0, n - SEQ_LEN, batch_size * n_batches + 1)
    assert np.all(flat >= np.floor(edges[:-1])) and np.all(flat < edges[1:])
    assert flat.max() <= n - SEQ_LEN - 1
    # each batch spans the split rather than one region of it
    assert all(batch.min() < n / 4 and batch.max() > 3 * n / 4 for batch in offsets)


def test_val_batches_need_a_validation_split_longer_than_a_sequence() -> None:
    with pytest.raises(DataError, match="data.val_fraction"):
        val_batches(TOKENS[:SEQ_LEN], SEQ_LEN, 4, 2)
