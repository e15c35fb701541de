"""The distributed, deterministic, resumable batch loader.

The global batch of optimizer step k is ``global_batch`` sequences whose start
offsets are drawn from ``np.random.default_rng([seed, k])`` uniformly over
``[0, len(tokens) - seq_len - 1]`` (both ends included); sequence i is
``x = tokens[o_i : o_i + seq_len]``, ``y = tokens[o_i + 1 : o_i + seq_len + 1]``.
It depends only on (seed, k): not on the world size, the parallel layout or the
steps before, so every layout trains on the same samples in the same order and a
resumed run starts at step k without replaying anything.

Data-parallel rank r of D takes the contiguous sequences
``[r * B / D, (r + 1) * B / D)`` of that global batch and splits them into
micro-batches of ``micro_batch`` consecutive sequences (gradient accumulation).

Throughput. ``prefetch`` steps are prepared ahead by one thread and handed over
``prefetch`` at a time (a hand-off per step would cost as much as gathering one); within a step,
``readers`` threads gather the rank's sequences, reader j taking the j-th of
``readers`` contiguous chunks of them, concatenated in order, so the batches are
the same whatever the number of readers. Reading is from memory maps: page faults
on cold storage block only the reader that takes them (numpy copies release the
GIL). Nothing here writes or locks a file: every rank reads on its own.

Test-only hook: ``MESHFORGE_DATA_DELAY_S=SECONDS[:DP_RANK]`` makes every reader
sleep SECONDS per sequence it reads (on data-parallel rank DP_RANK only, when
given): a slow storage system, for the data-wait tests. Never set it otherwise.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import torch

from meshforge.errors import ConfigError, DataError

Batch = tuple[torch.Tensor, torch.Tensor]  # (x, y), int64 [micro_batch, seq_len]
Gather = Callable[[object, np.ndarray, int], np.ndarray]  # (tokens, offsets, length) -> rows
_VAL_STREAM = 0x76616C  # "val": keeps validation draws apart from any training step's
DELAY_ENV = "MESHFORGE_DATA_DELAY_S"  # test-only: a slow reader (module docstring)


def _check_seed(seed: int) -> None:
    if seed < 0:  # np.random.SeedSequence takes non-negative entropy only
        raise ConfigError(f"train.seed must be >= 0 for the data sampler, got {seed}")


def global_batch_offsets(
    seed: int, step: int, n_tokens: int, seq_len: int, global_batch: int
) -> np.ndarray:
    """Start offsets (int64, shape [global_batch]) of the sequences of step ``step``."""
    _check_seed(seed)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    high = n_tokens - seq_len - 1
    if high < 0:
        raise DataError(
            f"the training tokens ({n_tokens}) are fewer than model.seq_len + 1 = {seq_len + 1}"
        )
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, high, size=global_batch, endpoint=True, dtype=np.int64)


def gather_sequences(tokens: object, offsets: np.ndarray, length: int) -> np.ndarray:
    """int64 array [len(offsets), length]: row i is ``tokens[offsets[i] : offsets[i] + length]``."""
    if isinstance(tokens, np.ndarray):
        return np.array(tokens[offsets[:, None] + np.arange(length)], dtype=np.int64)
    rows = [np.asarray(tokens[o : o + length]) for o in offsets.tolist()]  # type: ignore[index]
    if not rows:
        return np.empty((0, length), dtype=np.int64)
    return np.array(np.stack(rows), dtype=np.int64)


def read_delay_s(dp_rank: int) -> float:
    """Seconds each sequence read sleeps on this rank (``MESHFORGE_DATA_DELAY_S``; test-only)."""
    spec = os.environ.get(DELAY_ENV, "").strip()
    if not spec:
        return 0.0
    seconds, _, rank = spec.partition(":")
    if rank and int(rank) != dp_rank:
        return 0.0
    return max(float(seconds), 0.0)


class ParallelGather:
    """``gather_sequences`` split over ``readers`` threads: reader j gathers the j-th of
    ``readers`` contiguous chunks of the offsets; the rows come back in order."""

    def __init__(self, readers: int, delay_s: float = 0.0, name: str = "meshforge-read") -> None:
        if readers < 1:
            raise ConfigError(f"data.readers must be >= 1, got {readers}")
        self.readers = readers
        self.delay_s = delay_s
        self._pool = ThreadPoolExecutor(readers, thread_name_prefix=name) if readers > 1 else None

    def _read(self, tokens: object, offsets: np.ndarray, length: int) -> np.ndarray:
        if self.delay_s:
            time.sleep(self.delay_s * len(offsets))
        return gather_sequences(tokens, offsets, length)

    def __call__(self, tokens: object, offsets: np.ndarray, length: int) -> np.ndarray:
        if self._pool is None or len(offsets) < 2:
            return self._read(tokens, offsets, length)
        chunks = np.array_split(offsets, min(self.readers, len(offsets)))
        parts = self._pool.map(lambda chunk: self._read(tokens, chunk, length), chunks)
        return np.concatenate(list(parts))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def rank_slice(batch_size: int, dp_rank: int, dp_size: int) -> slice:
    """The sequences of a batch that data-parallel rank ``dp_rank`` of ``dp_size`` takes."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
    if batch_size % dp_size:
        raise ConfigError(f"batch size {batch_size} is not divisible by the dp degree {dp_size}")
    per_rank = batch_size // dp_size
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def _to_batch(rows: np.ndarray, pin_memory: bool) -> Batch:
    x = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
    if pin_memory:  # lets the trainer copy to the GPU with non_blocking=True
        x, y = x.pin_memory(), y.pin_memory()
    return x, y


def rank_micro_batches(
    tokens: object,
    *,
    seq_len: int,
    global_batch: int,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    step: int,
    pin_memory: bool = False,
    gather: Gather = gather_sequences,
) -> list[Batch]:
    """This rank's micro-batches of step ``step`` (the pure function behind the loader;
    ``gather`` reads the rows, e.g. a :class:`ParallelGather`)."""
    offsets = global_batch_offsets(seed, step, len(tokens), seq_len, global_batch)  # type: ignore[arg-type]
    mine = offsets[rank_slice(global_batch, dp_rank, dp_size)]
    rows = gather(tokens, mine, seq_len + 1)
    return [
        _to_batch(rows[i : i + micro_batch], pin_memory) for i in range(0, len(rows), micro_batch)
    ]


@dataclass
class StepBatch:
    """The micro-batches one data-parallel rank trains on at optimizer step ``step``."""

    step: int
    micro_batches: list[Batch]


@dataclass
class _Failure:
    exc: BaseException


class DistributedBatchLoader:
    """Iterator of :class:`StepBatch` for one data-parallel rank, from ``start_step`` on.

    With ``prefetch > 0`` a daemon thread prepares up to ``prefetch`` steps ahead
    in a bounded queue; an exception there is re-raised by ``next()``. ``readers``
    threads gather each step's sequences. The batches are the same whatever the
    prefetch depth and the number of readers. ``last_wait_s`` is how long the last
    ``next()`` waited for its batch, ``total_wait_s`` the sum; that is the
    data-wait time of the step-time breakdown (its share of the wall time is the
    data-wait fraction). Use ``close()`` or ``with``.
    """

    def __init__(
        self,
        tokens: object,
        seq_len: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        start_step: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
        readers: int = 1,
    ) -> None:
        per_rank = global_batch // dp_size
        if global_batch % dp_size or per_rank % micro_batch:
            raise ConfigError(
                f"train.global_batch={global_batch} is not divisible by "
                f"dp={dp_size} x train.micro_batch={micro_batch}"
            )
        rank_slice(global_batch, dp_rank, dp_size)  # validates dp_rank
        if len(tokens) < seq_len + 1:  # type: ignore[arg-type]
            raise DataError(
                f"the training tokens ({len(tokens)}) are fewer than "  # type: ignore[arg-type]
                f"model.seq_len + 1 = {seq_len + 1}"
            )
        if start_step < 0 or prefetch < 0:
            raise ValueError("start_step and prefetch must be >= 0")
        _check_seed(seed)
        self._gather = ParallelGather(readers, read_delay_s(dp_rank), f"meshforge-read-dp{dp_rank}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.prefetch = prefetch
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.last_wait_s = 0.0
        self.total_wait_s = 0.0
        self._next_step = start_step
        self._closed = False
        self._stop = threading.Event()
        # the thread hands over `prefetch` steps at a time: one hand-off (two thread
        # switches under the GIL) per step would cost about as much as gathering a step
        self._queue: queue.Queue[list[StepBatch] | _Failure] = queue.Queue(maxsize=1)
        self._ready: collections.deque[StepBatch] = collections.deque()
        self._thread: threading.Thread | None = None
        if prefetch > 0:
            self._thread = threading.Thread(
                target=self._produce,
                args=(start_step,),
                name=f"meshforge-data-dp{dp_rank}",
                daemon=True,
            )
            self._thread.start()

    @property
    def next_step(self) -> int:
        """The step the next ``next()`` returns (the data position to checkpoint)."""
        return self._next_step

    def batch_at(self, step: int) -> StepBatch:
        """This rank's batch of ``step``, computed now (no effect on the iterator)."""
        micro = rank_micro_batches(
            self.tokens,
            seq_len=self.seq_len,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            seed=self.seed,
            step=step,
            pin_memory=self.pin_memory,
            gather=self._gather,
        )
        return StepBatch(step=step, micro_batches=micro)

    @property
    def readers(self) -> int:
        return self._gather.readers

    def _put(self, item: StepBatch | _Failure) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, step: int) -> None:
        try:
            while self._put([self.batch_at(s) for s in range(step, step + self.prefetch)]):
                step += self.prefetch
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put(_Failure(exc))

    def __iter__(self) -> DistributedBatchLoader:
        return self

    def __next__(self) -> StepBatch:
        if self._closed:
            raise RuntimeError("DistributedBatchLoader is closed")
        start = time.perf_counter()
        if self._thread is None:
            item: StepBatch | _Failure = self.batch_at(self._next_step)
        else:
            if not self._ready:
                chunk = self._queue.get()
                if isinstance(chunk, _Failure):
                    item = chunk
                else:
                    self._ready.extend(chunk)
            if self._ready:
                item = self._ready.popleft()
        self.last_wait_s = time.perf_counter() - start
        self.total_wait_s += self.last_wait_s
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        self._next_step += 1
        return item

    def close(self) -> None:
        """Stop the prefetch thread and the readers, drop prepared batches; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            while True:  # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(timeout=10.0)
        self._gather.close()

    def __enter__(self) -> DistributedBatchLoader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class NoBatches:
    """The loader of a rank that reads no data (a parameter server, which trains on the
    workers' gradients): every step an empty batch, never a wait."""

    last_wait_s = 0.0
    total_wait_s = 0.0

    def __init__(self, start_step: int = 0) -> None:
        self._next_step = start_step

    @property
    def next_step(self) -> int:
        return self._next_step

    def __iter__(self) -> NoBatches:
        return self

    def __next__(self) -> StepBatch:
        self._next_step += 1
        return StepBatch(step=self._next_step - 1, micro_batches=[])

    def close(self) -> None:
        pass

    def __enter__(self) -> NoBatches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def val_offsets(
    n_tokens: int, seq_len: int, batch_size: int, n_batches: int, seed: int
) -> np.ndarray:
    """Start offsets (int64 [n_batches, batch_size]) of the fixed validation sequences.

    Stratified sampling: the valid offsets ``[0, n_tokens - seq_len - 1]`` are cut
    into ``n_batches * batch_size`` equal strata with one random offset
    (``default_rng([seed, _VAL_STREAM])``) in each, so the whole validation split
    is covered; batch b holds strata b, b + n_batches, b + 2 * n_batches, ...
    """
    high = n_tokens - seq_len - 1
    if high < 0:
        raise DataError(
            f"the validation split has {n_tokens} tokens, fewer than "
            f"model.seq_len + 1 = {seq_len + 1}; raise data.val_fraction or lower model.seq_len"
        )
    _check_seed(seed)
    total = batch_size * n_batches
    edges = np.linspace(0, high + 1, total + 1)
    u = np.random.default_rng([seed, _VAL_STREAM]).random(total)
    offsets = np.minimum(np.floor(edges[:-1] + u * np.diff(edges)), high).astype(np.int64)
    return offsets.reshape(batch_size, n_batches).T.copy()


def val_batches(
    val_tokens: object,
    seq_len: int,
    batch_size: int,
    n_batches: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
) -> list[Batch]:
    """This rank's fixed validation batches (the same list on every call).

    ``batch_size`` is sequences per batch for the whole job (see
    :func:`val_offsets`); rank r of D takes ``[r * B / D, (r + 1) * B / D)`` of each.
    """
    offsets = val_offsets(len(val_tokens), seq_len, batch_size, n_batches, seed)  # type: ignore[arg-type]
    mine = rank_slice(batch_size, dp_rank, dp_size)
    return [
        _to_batch(gather_sequences(val_tokens, batch[mine], seq_len + 1), False)
        for batch in offsets
    ]
