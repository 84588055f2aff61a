"""The next batch made while a step runs: the same batches, each collated once, and
ready before the host waits for the step's loss."""

import numpy as np
import pytest

from transduce.config import TrainConfig, preset
from transduce.train import loop
from transduce.train.state import BatchStream, Position


class ThreeBatchEpochs:
    """Epochs of three one-item batches, numbered by epoch; counts epoch_batches calls."""

    def __init__(self):
        self.made = []

    def epoch_batches(self, epoch):
        self.made.append(epoch)
        return [np.array([10 * epoch + i]) for i in range(3)]


def test_peek_shows_what_take_takes_across_an_epoch_and_moves_nothing():
    batcher, position = ThreeBatchEpochs(), Position(epoch=0, batch=1)
    stream = BatchStream(batcher, position)
    peeked = stream.peek_keyed(5)
    assert [key for key, _ in peeked] == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [int(indices[0]) for _, indices in peeked] == [1, 2, 10, 11, 12]
    assert (position.epoch, position.batch) == (0, 1)
    assert stream.peek_keyed(1)[0][0] == (0, 1)
    taken = stream.take_keyed(5)
    assert [key for key, _ in taken] == [key for key, _ in peeked]
    assert (position.epoch, position.batch) == (1, 3)
    assert [key for key, _ in stream.take_keyed(1)] == [(2, 0)]
    assert batcher.made == [0, 1, 2]       # each epoch's order made once, peeked or not


@pytest.mark.parametrize("update_freq", [1, 2])
def test_each_batch_is_collated_once_and_before_the_step_is_waited_for(
        tiny_corpus, tmp_path, monkeypatch, update_freq):
    events = []
    collate, wait = loop.Run._collate, loop._wait_for_losses

    def recorded_collate(run, key, indices):
        events.append(key)
        return collate(run, key, indices)

    def recorded_wait(losses):
        events.append("wait")
        return wait(losses)

    monkeypatch.setattr(loop.Run, "_collate", recorded_collate)
    monkeypatch.setattr(loop, "_wait_for_losses", recorded_wait)
    steps = 3
    model_config = preset("tiny", src_vocab_size=300, tgt_vocab_size=300)
    loop.train(tiny_corpus, tmp_path / "run", model_config,
               TrainConfig(max_tokens=200, max_steps=steps, update_freq=update_freq,
                           eval_every=1000, save_every=1000))
    keys = [event for event in events if event != "wait"]
    assert keys == sorted(set(keys)) and len(keys) == steps * update_freq + 1
    # The first batch, then each step: its other batches and the next step's first are
    # made, and only then is the step's loss waited for.
    expected = keys[:1]
    for step in range(steps):
        expected += keys[1 + step * update_freq:1 + (step + 1) * update_freq] + ["wait"]
    assert events == expected
