"""The main job, as far as the package goes today: build the models and run them.

The Bible corpus, the BPE vocabulary and the paper's training recipe are not part of the
package yet, so this demo says so and works on synthetic tokens instead:
  1. the paper's `base` and `big` models and the CPU `small` preset: sizes;
  2. one training step (forward + backward) of `small` on a random batch, per kernel;
  3. a `tiny` Transformer learns to copy random sequences, then decodes held-out
     sequences greedily through the KV cache (prefill once, one token per step).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from transduce.attention import masks
from transduce.config import preset
from transduce.decode import greedy_search
from transduce.model import Transformer

PAD, BOS, EOS = 0, 1, 2


def copy_task_batch(batch_size: int, vocab: int, max_len: int, generator: torch.Generator):
    """Random sequences and their copies: src (B, L), tgt_in (B, L + 1), tgt_out (B, L + 1)."""
    lengths = torch.randint(3, max_len + 1, (batch_size,), generator=generator)
    src = torch.randint(3, vocab, (batch_size, max_len), generator=generator)
    src = src.masked_fill(~masks.padding_mask(lengths, max_len)[:, 0, 0], PAD)
    tgt = torch.full((batch_size, max_len + 2), PAD)
    for row, length in enumerate(lengths.tolist()):
        tgt[row, 0] = BOS
        tgt[row, 1:length + 1] = src[row, :length]
        tgt[row, length + 1] = EOS
    return src, tgt[:, :-1], tgt[:, 1:]


def show_sizes() -> None:
    print("1. Model sizes (shared vocabulary of 37,000 as in the paper; 8,000 for small)")
    for name, vocab in [("base", 37000), ("big", 37000), ("small", 8000)]:
        model = Transformer(preset(name, src_vocab_size=vocab, tgt_vocab_size=vocab))
        print(f"   {name:6s} {model.num_parameters() / 1e6:7.1f}M parameters")


def training_step_per_kernel() -> None:
    print("\n2. One training step of `small` on random tokens (batch 32 x 40), per kernel")
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(3, 8000, (32, 40), generator=generator)
    tgt = torch.randint(3, 8000, (32, 41), generator=generator)
    for impl in ("naive", "sdpa", "flash"):
        torch.manual_seed(0)
        model = Transformer(preset("small", src_vocab_size=8000, tgt_vocab_size=8000,
                                   attention_impl=impl))
        start = time.perf_counter()
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())
        loss.backward()
        print(f"   {impl:6s} loss {loss.item():.4f} (ln 8000 = 8.99)  "
              f"{time.perf_counter() - start:.2f}s")


def copy_task(steps: int = 1000) -> None:
    print(f"\n3. A tiny Transformer learns to copy sequences of 3-12 symbols ({steps} steps)")
    torch.manual_seed(0)
    vocab, max_len = 24, 12
    model = Transformer(preset("tiny", src_vocab_size=vocab, tgt_vocab_size=vocab))
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.9, 0.98), eps=1e-9)
    generator = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        src, tgt_in, tgt_out = copy_task_batch(64, vocab, max_len, generator)
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            print(f"   step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - start:5.1f}s")

    model.eval()
    src, _, tgt_out = copy_task_batch(500, vocab, max_len, torch.Generator().manual_seed(99))
    output = greedy_search(model, src, bos_id=BOS, eos_id=EOS, max_len=tgt_out.shape[1])
    exact = sum(torch.equal(out[out != PAD], ref[ref != PAD]) for out, ref in zip(output, tgt_out))
    print(f"   held-out sequences copied exactly (greedy, KV cache): {exact}/500")
    for row in range(3):
        source = src[row][src[row] != PAD].tolist()
        copied = output[row][(output[row] != PAD) & (output[row] != EOS)].tolist()
        print(f"   {source} -> {copied}")


def main() -> None:
    print("transduce demo: the attention core and the Transformer on synthetic tokens.\n"
          "(Training on the built-in Bible corpus arrives with the data and training "
          "commands.)\n")
    show_sizes()
    training_step_per_kernel()
    copy_task()


if __name__ == "__main__":
    main()
