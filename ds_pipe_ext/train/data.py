"""Micro-batch streams that can resume, on any data-parallel size: synthetic tokens, or a Megatron indexed dataset.

A stream yields ``(inputs, labels)`` micro-batches of token ids, labels being the inputs
shifted by one.  ``position`` (micro-batches consumed by this data-parallel rank) is all
a checkpoint needs to continue the stream exactly where it stopped.

The indexed dataset (``PATH.bin`` + ``PATH.idx``, as Megatron's preprocessing writes it)
is read with megatron-core's own ``IndexedDataset``; its documents are taken as one
token stream cut into windows of seq + 1 tokens, each data-parallel rank reading every
dp-th window.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..config_model import ConfigError


class SyntheticTokens:
    """Random tokens, sample by sample: global sample g is drawn from a generator seeded with (seed, g), and
    data-parallel rank r of dp reads samples (position * dp + r) * micro_batch + i, as ``IndexedTokens``
    reads windows.  A step's samples are then the same whatever dp and the accumulation that make its
    global batch: a run resumed on fewer ranks, accumulating more, sees the samples it would have seen."""

    def __init__(self, vocab: int, micro_batch: int, seq: int, *, seed: int, position: int = 0, dp_rank: int = 0,
                 dp: int = 1):
        self.vocab, self.micro_batch, self.seq = vocab, micro_batch, seq
        self.seed, self.dp_rank, self.dp = seed, dp_rank, dp
        self.position = position

    def __iter__(self) -> Iterator:
        return self

    def _sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % 2**63)
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=gen)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = (self.position * self.dp + self.dp_rank) * self.micro_batch
        tokens = torch.stack([self._sample(first + i) for i in range(self.micro_batch)])
        self.position += 1
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class IndexedTokens:
    """Windows of seq + 1 tokens from a Megatron indexed dataset, dp-strided, wrapping around."""

    def __init__(self, prefix: str, micro_batch: int, seq: int, *, vocab: int, dp_rank: int, dp: int,
                 position: int = 0):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise ConfigError(f"train.data = {prefix!r}: {prefix}{suffix} is missing (a Megatron indexed dataset "
                                  f"is PATH.bin + PATH.idx, written by megatron-core's IndexedDatasetBuilder)")
        self.dataset = IndexedDataset(prefix)
        self.lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)))
        self.micro_batch, self.seq, self.dp_rank, self.dp = micro_batch, seq, dp_rank, dp
        self.windows = int(self.starts[-1]) // (seq + 1)
        if self.windows < 1:
            raise ConfigError(f"train.data = {prefix!r} holds {int(self.starts[-1])} tokens, fewer than one "
                              f"sequence of {seq + 1}")
        top = max(int(self.dataset[i].max()) for i in range(min(len(self.dataset), 64)))
        if top >= vocab:
            raise ConfigError(f"train.data = {prefix!r} has token id {top} >= the model's vocab_size {vocab}")
        self.position = position

    def __iter__(self) -> Iterator:
        return self

    def _window(self, index: int) -> np.ndarray:
        """Tokens [index * (seq + 1), (index + 1) * (seq + 1)) of the concatenated documents."""
        lo = (index % self.windows) * (self.seq + 1)
        hi = lo + self.seq + 1
        parts, doc = [], int(np.searchsorted(self.starts, lo, side="right")) - 1
        while lo < hi:
            offset = lo - int(self.starts[doc])
            length = min(hi - lo, int(self.lengths[doc]) - offset)
            parts.append(self.dataset.get(doc, offset=offset, length=length))
            lo += length
            doc += 1
        return np.concatenate(parts).astype(np.int64)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = (self.position * self.dp + self.dp_rank) * self.micro_batch
        tokens = torch.from_numpy(np.stack([self._window(first + i) for i in range(self.micro_batch)]))
        self.position += 1
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def token_stream(data: str | None, *, vocab: int, micro_batch: int, seq: int, seed: int, dp_rank: int, dp: int,
                 position: int = 0):
    if data is None:
        return SyntheticTokens(vocab, micro_batch, seq, seed=seed + 1000, position=position, dp_rank=dp_rank, dp=dp)
    return IndexedTokens(data, micro_batch, seq, vocab=vocab, dp_rank=dp_rank, dp=dp, position=position)
