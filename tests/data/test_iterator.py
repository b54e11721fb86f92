"""PromptIterator: seeded epochs, and a restored iterator continues with exactly the same batches."""

import json

import numpy as np
import pytest

from jaxrl_llm.data import DataError, PromptIterator

DATA = [f"item{i}" for i in range(10)]


def take(it, n):
    return [next(it) for _ in range(n)]


def test_epochs_are_seeded_permutations():
    it = PromptIterator(DATA, 3, seed=7, drop_last=False)
    assert it.steps_per_epoch == 4
    epoch0, epoch1 = take(it, 4), take(it, 4)
    assert [len(b) for b in epoch0] == [3, 3, 3, 1]
    assert sorted(sum(epoch0, [])) == sorted(DATA) == sorted(sum(epoch1, []))
    assert epoch0 != epoch1                                             # reshuffled each epoch
    assert take(PromptIterator(DATA, 3, seed=7, drop_last=False), 8) == epoch0 + epoch1
    assert take(PromptIterator(DATA, 3, seed=8, drop_last=False), 4) != epoch0
    # An epoch's order depends only on (seed, epoch), not on what ran before.
    np.testing.assert_array_equal(PromptIterator(DATA, 3, seed=7).epoch_order(5), it.epoch_order(5))


def test_drop_last_and_no_shuffle():
    it = PromptIterator(DATA, 4, seed=0, shuffle=False)
    assert it.steps_per_epoch == 2
    assert take(it, 3) == [DATA[0:4], DATA[4:8], DATA[0:4]]


@pytest.mark.parametrize("stop_after", [0, 2, 3, 4, 7])
def test_exact_resume_across_epoch_boundaries(stop_after):
    """10 items, batches of 3: 3 steps an epoch (drop_last), so 3 and 4 sit on either side of a boundary."""
    uninterrupted = take(PromptIterator(DATA, 3, seed=123), stop_after + 6)
    first = PromptIterator(DATA, 3, seed=123)
    assert take(first, stop_after) == uninterrupted[:stop_after]
    state = json.loads(json.dumps(first.state_dict()))                   # as saved in a checkpoint
    assert (state["epoch"], state["position"]) == divmod(stop_after, 3)
    resumed = PromptIterator(DATA, 3, seed=123)
    resumed.load_state_dict(state)
    assert take(resumed, 6) == uninterrupted[stop_after:]


def test_num_epochs_stops():
    assert len(list(PromptIterator(DATA, 5, seed=0, num_epochs=3))) == 6


def test_dataset_smaller_than_a_batch():
    with pytest.raises(DataError, match="the dataset has 10 prompts, fewer than one batch of 16"):
        PromptIterator(DATA, 16, seed=0)
    assert len(next(PromptIterator(DATA, 16, seed=0, drop_last=False))) == 10
    with pytest.raises(DataError, match="batch_size=0"):
        PromptIterator(DATA, 0, seed=0)
    with pytest.raises(DataError, match="the dataset has 0 prompts"):
        PromptIterator([], 1, seed=0, drop_last=False)


def test_load_state_dict_refuses_a_different_setup():
    state = PromptIterator(DATA, 3, seed=1).state_dict()
    with pytest.raises(DataError, match="state has seed=1 but this iterator has seed=2"):
        PromptIterator(DATA, 3, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="dataset_size=10 but this iterator has dataset_size=9"):
        PromptIterator(DATA[:9], 3, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match=r"the state lacks \['position'\]"):
        PromptIterator(DATA, 3, seed=1).load_state_dict({k: v for k, v in state.items() if k != "position"})
    with pytest.raises(DataError, match="position=3 is not a valid place"):
        PromptIterator(DATA, 3, seed=1).load_state_dict({**state, "position": 3})


def test_a_batch_carries_its_epoch_while_the_iterator_moves_on():
    """The last batch of an epoch belongs to it, though the iterator is already at the next epoch's start."""
    it = PromptIterator(DATA, 3, seed=7)
    epochs = []
    for _ in range(7):
        batch = next(it)
        epochs.append((batch.epoch, it.epoch))
    assert epochs == [(0, 0), (0, 0), (0, 1), (1, 1), (1, 1), (1, 2), (2, 2)]
