"""`transduce train`'s own steps, with the next batch made during each step
(train/prefetch.py: the loop as it ships) against the same loop collating each batch
after it has waited for the step's loss, and copying it from pageable memory (the loop
before prefetching).

One run set up as `transduce train` sets it up (train/loop.py set_up: data, model,
optimizer, --compile, --cuda-graphs), stepped by train_step in rounds, the two ways
alternating on the same model, each round on the stream's next batches (of one shape
when packed). Counts target tokens per second of whole steps (collating, copying,
forward, backward, Adam), and reports the host's milliseconds to collate one batch
alone. On a CPU the two should tie (the host computes the step itself, nothing runs
meanwhile); on a GPU the prepared batch saves up to the collating time a step.

    python bench/train_loop.py --data data/bible --preset small --max-tokens 4096
    python bench/train_loop.py --data data/bible --preset base --max-tokens 25000 \
        --pack-length 256 --impl triton --compile --cuda-graphs --dtype bfloat16  # a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import machine_info, write_result  # noqa: E402
from transduce.config import TrainConfig, preset  # noqa: E402
from transduce.data.tokenizer import MODEL_NAME, Tokenizer  # noqa: E402
from transduce.train import loop, prefetch  # noqa: E402

PREPARED, AFTER_THE_WAIT = "prepared during the step", "collated after the wait"


@contextlib.contextmanager
def collated_after_the_wait(run: loop.Run) -> Iterator[None]:
    """Meanwhile the loop prepares nothing ahead (each batch is collated when its step
    asks for it, after the last step's wait) and copies from pageable memory."""
    run.prefetch.prepared.clear()
    run.prefetch.prepare = lambda key, indices: None
    pinned, prefetch.pinned = prefetch.pinned, lambda batch: batch
    try:
        yield
    finally:
        del run.prefetch.prepare           # the class's method again
        prefetch.pinned = pinned


def tokens_per_second(run: loop.Run, steps: int, how: str) -> float:
    """`steps` training steps the way `how` says -> target tokens per second."""
    with collated_after_the_wait(run) if how == AFTER_THE_WAIT else contextlib.nullcontext():
        if how == PREPARED:   # as the loop would have left it after a step
            run.prefetch.prepare(*loop._first_of_next_step(run))
        synchronize(run.device)
        started, tokens = time.perf_counter(), 0
        for _ in range(steps):
            result = loop.train_step(run, 0.0)
            run.position.step += 1
            tokens += 0 if result is None else result.tokens
        synchronize(run.device)
        return tokens / (time.perf_counter() - started)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def collate_ms(run: loop.Run, count: int = 10) -> float:
    """The host's median milliseconds to collate one of the stream's next batches."""
    times = []
    for key, indices in run.stream.peek_keyed(count):
        started = time.perf_counter()
        run._collate(key, indices)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--impl", default="sdpa", help="the model's attention_impl")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--pack-length", type=int, default=0)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and way")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    vocab = Tokenizer(args.data / MODEL_NAME).vocab_size
    model_config = preset(args.preset, src_vocab_size=vocab, tgt_vocab_size=vocab,
                          attention_impl=args.impl)
    train_config = TrainConfig(max_tokens=args.max_tokens, pack_length=args.pack_length,
                               dtype=args.dtype, compile=args.compile,
                               cuda_graphs=args.cuda_graphs)
    with tempfile.TemporaryDirectory() as out:
        run = loop.set_up(args.data, Path(out), model_config, train_config, 1, 0,
                          resume=False, init=None)
        ways = (PREPARED, AFTER_THE_WAIT)
        for how in ways:                     # compiled, graphs recorded, allocator settled
            tokens_per_second(run, 3, how)
        rates = {how: [] for how in ways}
        for round_ in range(args.rounds):
            for how in ways if round_ % 2 == 0 else ways[::-1]:
                rates[how].append(tokens_per_second(run, args.steps, how))
        collating = collate_ms(run)
        device = torch.cuda.get_device_name() if run.device.type == "cuda" else "cpu"
    medians = {how: statistics.median(r) for how, r in rates.items()}
    for how in ways:
        print(f"{how:26s} {medians[how]:12,.0f} target tok/s  (rounds: "
              f"{', '.join(f'{r:,.0f}' for r in rates[how])})")
    print(f"prepared / after the wait: {medians[PREPARED] / medians[AFTER_THE_WAIT]:.3f}x; "
          f"collating one batch alone: {collating:.1f} ms on the host")
    out = args.out or Path(__file__).parent / "results" / \
        f"train-loop-{'cuda' if device != 'cpu' else 'cpu'}.json"
    write_result(out, {"benchmark": "train_loop", "device": device,
                       "machine": machine_info(torch.get_num_threads()),
                       "settings": {k: str(v) for k, v in vars(args).items()},
                       "target_tokens_per_s": rates, "medians": medians,
                       "ratio_prepared_to_after_the_wait":
                           medians[PREPARED] / medians[AFTER_THE_WAIT],
                       "collate_ms_median": collating,
                       "command": "python bench/train_loop.py " + " ".join(sys.argv[1:])})


if __name__ == "__main__":
    main()
