"""Continuous generation (the server's, decode/continuous_generation.py) of a model whose
sliding-window layers mix with full ones, Gemma 3's layout: its steps through the
written-out layers (model/decoder_step.py, each row reading its own slots through the
one-query kernel, a sliding layer's from its band) against the modules under a key mask
(the decoder's fast_step set aside, as every such step ran before).

The model: Gemma 3 270M's shape (18 layers of 640, 4 query heads of 256 sharing one
key/value head, a gated GELU feed-forward of 2048, RMS sandwich norms, rotary positions
with a local base on the sliding layers, a window of 512 on every layer but each sixth)
with random weights, over a byte-level BPE of --vocab tokens trained here on the Python
standard library's sources (bench/constrained.py's; Gemma's own has 262,144, whose
output projection would weigh more than the layers). --prompts prompts of 8 to 40
random tokens, greedy, at most --new-tokens each, --running at a time, newcomers joining
as rows finish; the two peers in alternating order over --rounds rounds, per --dtypes.
Counted: the tokens generated (each peer its own) per second of the whole run, and how
many continuations differ between the two.

    python bench/continuous_generation.py [--dtypes float32 int8] [--running 1 8 16]
        [--out bench/results/continuous-generation-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from constrained import END, train_vocabulary  # noqa: E402
from measure import machine_info, run_joining  # noqa: E402
from transduce.config import ModelConfig  # noqa: E402
from transduce.data.hf_tokenizer import HFTokenizer  # noqa: E402
from transduce.decode.continuous_generation import ContinuousGeneration  # noqa: E402
from transduce.decode.generate import Generator  # noqa: E402
from transduce.decode.options import GenerateOptions  # noqa: E402
from transduce.model import build_model  # noqa: E402


def gemma3_shaped(vocab: int) -> torch.nn.Module:
    """Gemma 3 270M's layers at our vocabulary, random weights."""
    torch.manual_seed(0)
    config = ModelConfig(
        arch="decoder", src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=640,
        num_heads=4, num_kv_heads=1, head_size=256, d_ff=2048, num_decoder_layers=18,
        num_encoder_layers=1, max_positions=2048, positional="rotary", rope_base=1e6,
        local_rope_base=1e4, norm="rms", norm_first=True, sandwich_norm=True,
        gated_ffn=True, activation="gelu", attention_type="sliding", attention_window=512,
        full_attention_layers=(5, 11, 17), tie_embeddings="all", dropout=0.0)
    return build_model(config).eval()


def generate(generator: Generator, prompts: list[list[int]], running: int,
             new_tokens: int) -> tuple[float, list[list[int]]]:
    """-> generated tokens per second, and each prompt's tokens."""
    generation = ContinuousGeneration(generator, GenerateOptions(max_new_tokens=new_tokens))
    seconds, found = run_joining(
        generation, len(prompts), running,
        lambda joining: generation.add([prompts[i] for i in joining], joining))
    tokens = [continuation.tokens for continuation in found]
    return sum(map(len, tokens)) / seconds, tokens


def compare(generator: Generator, prompts: list[list[int]], running: int, args) -> dict:
    """The written-out step against the modules, alternating, on one generator."""
    step = generator.model.decoder.fast_step
    peers = {"written-out step": step, "modules": None}
    rates: dict[str, list[float]] = {name: [] for name in peers}
    outputs = {}
    for round_ in range(args.rounds + 1):                     # the first warms up
        for name in peers if round_ % 2 == 0 else reversed(list(peers)):
            generator.model.decoder.fast_step = peers[name]
            rate, outputs[name] = generate(generator, prompts, running, args.new_tokens)
            if round_:
                rates[name].append(round(rate, 1))
    generator.model.decoder.fast_step = step
    medians = {name: statistics.median(found) for name, found in rates.items()}
    return {"running": running, "tokens_per_second": rates, "medians": medians,
            "speed-up": medians["written-out step"] / medians["modules"],
            "continuations_differing": sum(a != b for a, b in zip(*outputs.values()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "int8"])
    parser.add_argument("--running", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path,
                        default=Path("bench/results/continuous-generation-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "tokenizer.json"
        train_vocabulary(args.vocab, path)
        tokenizer = HFTokenizer.from_file(path, bos=END, eos=END)
    model = gemma3_shaped(tokenizer.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(256, tokenizer.vocab_size) for _ in range(rng.randint(8, 40))]
               for _ in range(args.prompts)]
    results = []
    for dtype in args.dtypes:
        generator = Generator(model, tokenizer, dtype=dtype)
        for running in args.running:
            result = {"dtype": dtype, **compare(generator, prompts, running, args)}
            results.append(result)
            print(f"{dtype}, {running} running: written-out step "
                  f"{result['medians']['written-out step']:.1f} tokens/s, modules "
                  f"{result['medians']['modules']:.1f} ({result['speed-up']:.2f}x), "
                  f"{result['continuations_differing']} of {len(prompts)} differ", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "continuous generation, Gemma 3's layout",
        "machine": machine_info(args.threads),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "parameters": model.num_parameters(), "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
