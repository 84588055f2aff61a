"""Language-model generation speed: our decoder-only model against Hugging Face's
`GPT2LMHeadModel.generate`, on the same weights.

A GPT-2 (124M, `--layers` etc. to change) is built by transformers from a random config,
saved with save_pretrained, and imported with `transduce import hf-gpt2`, so both sides
hold the same weights. Greedy generation of --new-tokens tokens from prompts of
--prompt-length random tokens, batch 1 and batch 8 (same-length prompts: no padding on
either side), float32, interleaved over --repeats rounds. Counted: generated tokens (the
same on both sides, checked token for token), per second of the whole call (prompt
prefill included). Decode speed by KV-cache kind (float32, int8, int4, sliding) is
bench/kv_cache.py's.

    python bench/generate.py [--repeats 3] [--out bench/results/generate-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, time_interleaved  # noqa: E402
from transduce.decode.generate import Generator  # noqa: E402
from transduce.decode.options import GenerateOptions  # noqa: E402
from transduce.importers.hf_gpt2 import import_gpt2  # noqa: E402
from transduce.model import load_model  # noqa: E402


def build_hf_model(args: argparse.Namespace, directory: Path):
    """A random GPT-2 from transformers, saved where our importer reads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=args.heads,
                        n_positions=args.context)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(directory)
    # A byte-level vocabulary of GPT-2's size: the tokens are random ids anyway.
    vocab = {f"t{i}": i for i in range(config.vocab_size - 1)}
    vocab["<|endoftext|>"] = config.vocab_size - 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    return model


def prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (batch, length), generator=generator)   # no eos


def compare_with_hf(hf, ours: Generator, args: argparse.Namespace) -> list[dict]:
    options = GenerateOptions(max_new_tokens=args.new_tokens, batch_sentences=8)
    eos = ours.tokenizer.eos_id
    rows = []
    for batch in (1, 8):
        ids = prompts(batch, args.prompt_length, hf.config.vocab_size, seed=batch)
        outputs: dict[str, list[list[int]]] = {}

        def run_hf():
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=args.new_tokens, pad_token_id=eos)
            outputs["hf"] = [[t for t in row if t != eos] for row in
                             out[:, ids.shape[1]:].tolist()]

        def run_ours():
            found = ours._generate_batch(ids.tolist(), options)
            outputs["ours"] = [row.tokens for row in found]

        times = time_interleaved({"hf generate": run_hf, "ours": run_ours}, args.repeats)
        tokens = sum(len(row) for row in outputs["ours"])
        equal = outputs["ours"] == outputs["hf"]
        record = {"batch": batch, "prompt_length": args.prompt_length, "generated_tokens": tokens,
                  "equal_outputs": equal}
        for name, seconds in times.items():
            record[name] = {"seconds": statistics.median(seconds),
                            "tokens_per_s": tokens / statistics.median(seconds)}
        record["ratio"] = record["ours"]["tokens_per_s"] / record["hf generate"]["tokens_per_s"]
        print(f"batch {batch}: ours {record['ours']['tokens_per_s']:.1f} tok/s, HF generate "
              f"{record['hf generate']['tokens_per_s']:.1f} tok/s: {record['ratio']:.2f}x; "
              f"{tokens} tokens, outputs equal: {equal}")
        rows.append(record)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("bench/results/generate-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        hf = build_hf_model(args, Path(scratch) / "hf")
        import_gpt2(Path(scratch) / "hf", Path(scratch) / "ours")
        ours = Generator.load(Path(scratch) / "ours")
        model = load_model(Path(scratch) / "ours")
    started = time.time()
    result = {"machine": machine_info(args.threads), "settings": vars(args) | {"out": str(args.out)},
              "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads,
                        "parameters": model.num_parameters()},
              "versus_hf_generate": compare_with_hf(hf, ours, args),
              "seconds": time.time() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
