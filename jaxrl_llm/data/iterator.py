"""`PromptIterator`: seeded, epoch-wise shuffled batches of prompts that resume exactly.

The order of epoch e is a permutation drawn from (seed, e) alone, so the iterator's whole state is
(epoch, position): restoring it from a checkpoint yields the very batches an uninterrupted run would.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from jaxrl_llm.data.errors import DataError

_STATE_VERSION = 1


class _Sized(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Any: ...


class PromptBatch(list):
    """A batch of dataset items and the epoch it belongs to. The iterator's own epoch moves on as soon as an epoch's
    last batch is drawn, so a step's epoch (`training/epoch`) is read from its batch, not from the iterator."""

    def __init__(self, items, epoch: int):
        super().__init__(items)
        self.epoch = epoch


class PromptIterator:
    """Yields batches (lists of dataset items) forever, or for `num_epochs` epochs.

    Args:
      dataset: anything with `len` and integer indexing (e.g. `PromptDataset`).
      batch_size: items per batch.
      seed: the shuffle seed.
      shuffle: shuffle each epoch; if False, every epoch is in dataset order.
      drop_last: drop the last partial batch of an epoch (so every batch has `batch_size` items).
      num_epochs: stop after this many epochs; None runs forever.
    """

    def __init__(self, dataset: _Sized, batch_size: int, *, seed: int, shuffle: bool = True,
                 drop_last: bool = True, num_epochs: int | None = None):
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise DataError(f"PromptIterator: batch_size={batch_size!r}; use a positive int")
        n = len(dataset)
        if n == 0 or (drop_last and n < batch_size):
            files = getattr(dataset, "files", None)  # a PromptDataset's; names the data in the error
            where = f" (the prompts left from {', '.join(files)} after filtering)" if files else ""
            raise DataError(f"PromptIterator: the dataset has {n} prompts, fewer than one batch of "
                            f"{batch_size}{where}; lower the batch size (gin: data.train_batch_size) or use "
                            "more data")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_epochs = num_epochs
        self.steps_per_epoch = n // batch_size if drop_last else -(-n // batch_size)
        self.epoch = 0
        self.position = 0  # batches already yielded in this epoch
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """[len(dataset)] the dataset indices of `epoch`, in the order they are served."""
        if self._order_epoch != epoch:
            n = len(self.dataset)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> PromptBatch:
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        order = self.epoch_order(self.epoch)
        start = self.position * self.batch_size
        batch = PromptBatch([self.dataset[int(i)] for i in order[start:start + self.batch_size]], self.epoch)
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """A JSON-able state; with the same dataset, `load_state_dict` continues from here exactly."""
        return {"version": _STATE_VERSION, "epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from `state`; one clear error if it was saved for another dataset or setting."""
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise DataError(f"PromptIterator.load_state_dict: the state lacks {missing}; was it saved by "
                            "PromptIterator.state_dict()?")
        for key in ("version", "seed", "batch_size", "shuffle", "drop_last", "dataset_size"):
            if state[key] != expected[key]:
                raise DataError(
                    f"PromptIterator.load_state_dict: the state has {key}={state[key]!r} but this iterator "
                    f"has {key}={expected[key]!r}; the batches would differ from the saved run. Build the "
                    "iterator with the same dataset, batch_size, seed, shuffle and drop_last")
        epoch, position = state["epoch"], state["position"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int)
                and 0 <= position < self.steps_per_epoch):
            raise DataError(f"PromptIterator.load_state_dict: epoch={epoch!r}, position={position!r} is "
                            f"not a valid place (steps_per_epoch={self.steps_per_epoch})")
        self.epoch, self.position = epoch, position
