"""Speed of a T5 import (Flan-T5's layout) against transformers and CTranslate2, at the
shape of flan-t5-small (d_model 512, 8 + 8 layers, 6 heads of 64, gated-GELU FFN 1024,
32,128 ids, an lm_head of its own) or flan-t5-base (--size base: 768, 12 + 12 layers,
12 heads, FFN 2048), with random weights (no network here: the real checkpoints cannot
be fetched, and speed does not depend on what the weights hold).

It writes a Hugging Face T5 directory (random T5ForConditionalGeneration weights; an
spiece.model of T5's size, pieces ▁w0, ▁w1, ..., and 100 sentinels), imports it
(`transduce import hf-t5`), exports the import to CTranslate2, and decodes the same
sentences (random words) with every peer, batch by batch, interleaved over --repeats
rounds:

    ours float32 / bfloat16 / int8   the Translator's decoding copy at that --dtype, and
                                     its searches (greedy_hypotheses, beam_search)
    ours float32 modules             the same without the written-out encoder pass and
                                     decoder step (model/encoder_pass.py, decoder_step.py),
                                     which T5's relative-position bias kept it from before
    hf generate                      T5ForConditionalGeneration.generate, float32, its
                                     cache, pad and the rows past the tokenizer's banned
                                     (ours never outputs them)
    ct2 float32 / int8               CTranslate2's Translator on our export, each call in
                                     a child process that times itself

Random weights rarely choose eos, so every peer writes --new-tokens tokens per sentence
(checked: the tokens each counts are the same), and tokens/s compares like with like.
Our float32 outputs are checked equal to transformers' and to its modules', at every
beam. Writes JSON with the machine's description.

    python bench/t5.py [--size small|base --sentences 16 --batch-sentences 8 --new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info  # noqa: E402
from translation_peers import Batches, HuggingFacePeer, add_run_options, ct2_peer, \
    every_beam, our_peer, random_lines, write_word_pieces  # noqa: E402

SPM_PIECES, EXTRA_IDS = 32_000, 100            # T5's spiece.model and its sentinels
SHAPES = {"small": dict(d_model=512, num_layers=8, num_decoder_layers=8, num_heads=6, d_kv=64,
                        d_ff=1024),
          "base": dict(d_model=768, num_layers=12, num_decoder_layers=12, num_heads=12,
                       d_kv=64, d_ff=2048)}
COMMON = dict(vocab_size=32_128, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
              dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
PEERS = ("ours float32", "ours bfloat16", "ours int8", "ours float32 modules", "hf generate",
         "ct2 float32", "ct2 int8")


def write_vocabulary(directory: Path) -> None:
    """spiece.model as T5's: <pad>, </s>, <unk>, then pieces ▁w0 ... (whole words), and
    tokenizer_config.json with its 100 sentinels."""
    write_word_pieces(directory / "spiece.model", {"<pad>": 0, "</s>": 1, "<unk>": 2},
                      SPM_PIECES)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "T5Tokenizer", "extra_ids": EXTRA_IDS}))


def write_t5(directory: Path, size: str) -> None:
    """A Hugging Face T5 directory of flan-t5-`size`'s shape, random weights."""
    import transformers

    directory.mkdir(parents=True)
    write_vocabulary(directory)
    torch.manual_seed(0)
    config = transformers.T5Config(**SHAPES[size], **COMMON)
    model = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():      # an lm_head of its own, as Flan-T5's checkpoints store it
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight) * 0.05)
    model.save_pretrained(directory)


def hugging_face(directory: Path, batches: Batches, new_tokens: int):
    """transformers' generate on the directory, pad and the rows past the tokenizer's
    banned (our import never outputs them)."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.T5ForConditionalGeneration.from_pretrained(directory).eval()
    banned = [0] + list(range(SPM_PIECES + EXTRA_IDS, COMMON["vocab_size"]))
    return HuggingFacePeer(model, batches, new_tokens, banned)


def their_ids(tokenizer, ids: list[int]) -> list[int]:
    """Our ids -> T5's: ▁wN is N + 3; a sentinel ▁<extra_id_K> is 32,099 - K."""
    found = []
    for piece in map(tokenizer.piece, ids):
        if piece.startswith("\u2581<extra_id_"):
            found.append(SPM_PIECES + EXTRA_IDS - 1 - int(piece[11:-1]))
        else:
            found.append(int(piece[2:]) + 3)
    return found


def peer(name: str, work: Path, translators: dict, batches: Batches, new_tokens: int):
    """call(beam, outputs, name) of one peer: decodes every batch into outputs[name];
    CTranslate2's returns the seconds its child process timed."""
    if name.startswith("ours"):
        return our_peer(translators[name], batches, new_tokens)
    if name == "hf generate":
        return hugging_face(work / "hf", batches, new_tokens)
    return ct2_peer(work / "ours", work, name.split()[1], batches, new_tokens)


def run(args: argparse.Namespace, work: Path) -> None:
    """Every peer at every beam, interleaved; the results written to args.out."""
    from transduce.decode.translate import Translator
    from transduce.importers import import_t5

    if not (work / "hf" / "config.json").is_file():
        write_t5(work / "hf", args.size)
    if not (work / "ours" / "config.json").is_file():
        import_t5(work / "hf", work / "ours")
    translators = {name: Translator.load(work / "ours", dtype=name.split()[1])
                   for name in args.peers if name.startswith("ours")}
    if "ours float32 modules" in translators:
        modules = translators["ours float32 modules"].model
        modules.encoder.fast_pass = modules.decoder.fast_step = None
    translator = next(iter(translators.values()), None) or Translator.load(work / "ours")
    source = translator.encode(random_lines(args, SPM_PIECES - 3))
    tokenizer = translator.tokenizer
    batches = Batches(args, tokenizer, source,
                      torch.tensor([their_ids(tokenizer, ids) + [1] for ids in source]))
    peers = {name: peer(name, work, translators, batches, args.new_tokens)
             for name in args.peers}

    def compare(beam: int, outputs: dict, equal: dict) -> None:
        if "hf generate" in outputs and "ours float32" in outputs:
            equal[f"ours float32 = hf generate, beam {beam}"] = outputs["hf generate"] == \
                [their_ids(tokenizer, o) for o in outputs["ours float32"]]
        if "ours float32 modules" in outputs and "ours float32" in outputs:
            equal[f"ours float32 = its modules, beam {beam}"] = \
                outputs["ours float32 modules"] == outputs["ours float32"]

    results = every_beam(args, peers, compare)
    results.update({"machine": machine_info(torch.get_num_threads()),
                    "shape": {**SHAPES[args.size], **COMMON, "size": args.size},
                    "sentences": args.sentences, "batch_sentences": args.batch_sentences,
                    "source_tokens": batches.source_tokens, "new_tokens": args.new_tokens,
                    "repeats": args.repeats})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SHAPES), default="small")
    add_run_options(parser, PEERS)
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/t5-<size>-cpu.json")
    args = parser.parse_args()
    args.out = args.out or Path(__file__).parent / "results" / f"t5-{args.size}-cpu.json"
    with tempfile.TemporaryDirectory(prefix="transduce-t5-bench-") as scratch:
        run(args, args.work or Path(scratch))


if __name__ == "__main__":
    main()
