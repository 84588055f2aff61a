"""Which type decodes fastest on this CPU, by model size: the float32, bfloat16 and int8
decoding copies (`--dtype`) of the same random weights, side by side, interleaved.

`--dtype auto` picks one type from the CPU and the model (decode/options.py); this is
what that choice rests on. A decoding step multiplies its rows by every weight: with
many rows (a batch of beams) or small weights, AMX's bfloat16 tiles compute fastest;
with one row of a large model, the weights stream from memory at every step and int8
reads half the bytes.

- translation: encoder-decoders of the presets small (256 wide, 3 + 3 layers), base
  (512, 6 + 6) and big (1024, 6 + 6) at the corpus's vocabulary, translating --lines
  test verses in batches of --batch-sentences, beam 4 and greedy, with the workers
  `translate` runs by default (two on a 2-core CPU);
- language models: decoders of gpt-small's layout 256, 512, 768 and 1024 wide (4, 8, 12
  and 12 layers; gpt2's shape at 768) at the same vocabulary, greedy from 32-token
  prompts, batch 1 and 8.

The random weights' rows of the special ids are zero, so every side writes --new-tokens
pieces a sentence (the mean of each side's outputs is recorded to show it). Counted:
sentences (translation) or generated tokens (language models) per second, the median of
--repeats interleaved rounds, and each type's ratio to bfloat16 (to float32 where
--dtypes leaves bfloat16 out: on a CPU without bfloat16 units it multiplies some 30x
slower, and float32 against int8 is the choice there).

`--dtypes ... int8-onednn` adds the int8 copy with its products through oneDNN's kernel
where the VNNI kernel would take them (model/int8_vnni.py; the same outputs).

    python bench/decode_dtypes.py --data data/bible [--lines 256] [--repeats 3]
        [--dtypes float32 int8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import int8_through_onednn, machine_info, time_interleaved  # noqa: E402
from transduce.config import preset  # noqa: E402
from transduce.data.corpus import read_lines, split_files  # noqa: E402
from transduce.data.tokenizer import MODEL_NAME, UNK_ID, Tokenizer  # noqa: E402
from transduce.decode.generate import Generator  # noqa: E402
from transduce.decode.options import GenerateOptions  # noqa: E402
from transduce.decode.translate import Translator  # noqa: E402
from transduce.model import build_model  # noqa: E402
from transduce.runtime import keep_freed_memory  # noqa: E402

DTYPES = ("float32", "bfloat16", "int8")
# int8 through oneDNN's kernel where the VNNI kernel would run (the same bits, slower)
ONEDNN_INT8 = "int8-onednn"
TRANSLATION = {"small": preset("small"), "base": preset("base"), "big": preset("big")}
LANGUAGE_MODELS = {
    f"{width} wide, {layers} layers": preset("gpt-small", d_model=width, num_heads=width // 64,
                                             d_ff=4 * width, num_decoder_layers=layers)
    for width, layers in ((256, 4), (512, 8), (768, 12), (1024, 12))}


def random_model(config, vocab: int):
    """A model of `config` at the corpus's vocabulary, seeded: every type copies it. The
    special ids' rows (pad, bos, eos, unk) are zero, so that none of them outscores every
    random logit: each sentence runs to the length limit in pieces of text (a random
    model can otherwise end every sentence at once, or write only padding)."""
    torch.manual_seed(0)
    model = build_model(config.replace(src_vocab_size=vocab, tgt_vocab_size=vocab)).eval()
    with torch.no_grad():
        model.output_proj.weight[:UNK_ID + 1] = 0
    return model


def copy(dtype: str, build):
    """build(type) for one of DTYPES, or for ONEDNN_INT8: int8 through oneDNN's kernel."""
    with int8_through_onednn(dtype == ONEDNN_INT8):
        return build("int8" if dtype == ONEDNN_INT8 else dtype)


def compare_translation(name: str, config, tokenizer: Tokenizer, sources: list[str],
                        args: argparse.Namespace) -> list[dict]:
    model = random_model(config, tokenizer.vocab_size)
    translators = {dtype: copy(dtype, lambda type_: Translator(model, tokenizer, dtype=type_,
                                                               workers="auto"))
                   for dtype in args.dtypes}
    rows = []
    for beam in (4, 1):
        outputs: dict[str, list[str]] = {}

        def call(dtype: str):
            def run():
                outputs[dtype] = translators[dtype].translate(
                    sources, beam=beam, batch_sentences=args.batch_sentences,
                    batch_tokens=1 << 30, max_length=args.new_tokens)
            return run

        times = time_interleaved({dtype: call(dtype) for dtype in args.dtypes}, args.repeats)
        rate = {d: len(sources) / statistics.median(times[d]) for d in args.dtypes}
        pieces = {d: statistics.mean(len(ids) for ids in tokenizer.encode(outputs[d]))
                  for d in args.dtypes}
        rows.append(record("translation", name, model.num_parameters(), {"beam": beam}, rate,
                           times, pieces, "sentences_per_s"))
    return rows


def compare_language_model(name: str, config, tokenizer: Tokenizer,
                           args: argparse.Namespace) -> list[dict]:
    model = random_model(config, tokenizer.vocab_size)
    generators = {dtype: copy(dtype, lambda type_: Generator(model, tokenizer, dtype=type_))
                  for dtype in args.dtypes}
    options = GenerateOptions(max_new_tokens=args.new_tokens, batch_sentences=8)
    rows = []
    for batch in (1, 8):
        prompts = torch.randint(4, tokenizer.vocab_size, (batch, 32),
                                generator=torch.Generator().manual_seed(batch)).tolist()
        tokens: dict[str, int] = {}

        def call(dtype: str):
            def run():
                found = generators[dtype]._generate_batch(prompts, options)
                tokens[dtype] = sum(len(row.tokens) for row in found)
            return run

        times = time_interleaved({dtype: call(dtype) for dtype in args.dtypes}, args.repeats)
        rate = {d: tokens[d] / statistics.median(times[d]) for d in args.dtypes}
        rows.append(record("language model", name, model.num_parameters(), {"batch": batch}, rate,
                           times, {d: tokens[d] / batch for d in args.dtypes}, "tokens_per_s"))
    return rows


def record(shape: str, name: str, parameters: int, setting: dict, rate: dict, times: dict,
           mean_output: dict, unit: str) -> dict:
    base = "bfloat16" if "bfloat16" in rate else "float32"
    over = {d: rate[d] / rate[base] for d in rate}
    row = {"shape": shape, "model": name, "parameters": parameters, **setting,
           unit: rate, "seconds": times, "mean_output_tokens": mean_output,
           f"over_{base}": over}
    print(f"{shape}, {name} ({parameters / 1e6:.1f}M), {setting}: " + ", ".join(
        f"{d} {rate[d]:.1f} ({over[d]:.2f}x)" for d in rate) +
        f" {unit}; mean output " + ", ".join(f"{mean_output[d]:.1f}" for d in rate),
        flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/bible"))
    parser.add_argument("--split", default="test")
    parser.add_argument("--lines", type=int, default=256)
    parser.add_argument("--batch-sentences", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=["translation", "language-model"],
                        choices=["translation", "language-model"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES),
                        choices=(*DTYPES, ONEDNN_INT8),
                        help="the types compared (ratios to bfloat16, else to float32)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode-dtypes-cpu.json"))
    args = parser.parse_args()
    keep_freed_memory()        # what `transduce translate` and `generate` do for their process
    tokenizer = Tokenizer(args.data / MODEL_NAME)
    sources = read_lines(split_files(args.data, args.split)[0])[:args.lines]
    rows = []
    if "translation" in args.shapes:
        for name, config in TRANSLATION.items():
            rows += compare_translation(name, config, tokenizer, sources, args)
    if "language-model" in args.shapes:
        for name, config in LANGUAGE_MODELS.items():
            rows += compare_language_model(name, config, tokenizer, args)
    result = {"benchmark": "decode-dtypes", "data": str(args.data), "lines": len(sources),
              "new_tokens": args.new_tokens, "machine": machine_info(torch.get_num_threads()),
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
