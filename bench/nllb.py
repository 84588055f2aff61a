"""Translation speed of an NLLB-200 import against transformers and CTranslate2, at the
shape of nllb-200-distilled-600M (d_model 1024, 12 + 12 layers, FFN 4096, 16 heads,
256,206 ids), with random weights (no network here: the real checkpoint cannot be
fetched, and speed does not depend on what the weights hold).

It writes a Hugging Face NLLB directory (random M2M100 weights; a vocabulary of NLLB's
size, pieces ▁w0, ▁w1, ... in a BPE SentencePiece model and its tokenizer.json, with
the 202 language codes), imports it (`transduce import hf-nllb`), exports the import to
CTranslate2, and translates the same sentences (random words, eng_Latn -> fra_Latn)
with every peer, batch by batch, interleaved over --repeats rounds:

    ours float32 / bfloat16 / int8   the Translator's decoding copy at that --dtype, and
                                     its searches (greedy_hypotheses, beam_search)
    onnx float32 / int8              our ONNX export (`export onnx`, `--quantize int8`)
                                     run by ONNX Runtime behind the same searches
    hf generate                      M2M100ForConditionalGeneration.generate, float32,
                                     forced_bos_token_id
    ct2 float32 / int8               CTranslate2's Translator on our export, target_prefix
                                     [code], each call in a child process that times itself
                                     (CTranslate2 slows PyTorch in a process it is loaded in)

Random weights never choose eos, so every peer writes --new-tokens tokens per sentence
(checked: the tokens each counts are the same), and tokens/s compares like with like.
Greedy float32 outputs are checked equal to transformers'. Writes JSON with the
machine's description.

    python bench/nllb.py [--sentences 16 --batch-sentences 8 --new-tokens 24]
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

CODES = ["eng_Latn", "fra_Latn"] + [f"x{i:02d}_Test" for i in range(200)]   # 202 codes
SPM_PIECES = 256_000          # NLLB's SentencePiece model; ids +1 in its dictionary
SHAPE = dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
             decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096,
             max_position_embeddings=1024, scale_embedding=True, pad_token_id=1,
             bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
             vocab_size=SPM_PIECES + 1 + len(CODES) + 1 + 2)     # + <mask>, + 2 unnamed rows
# nllb-200-3.3B's sizes, for bench/load.py (its import and load on a machine of 24 GB)
SHAPE_3B = {**SHAPE, "d_model": 2048, "encoder_layers": 24, "decoder_layers": 24,
            "encoder_ffn_dim": 8192, "decoder_ffn_dim": 8192}
PEERS = ("ours float32", "ours bfloat16", "ours int8", "onnx float32", "onnx int8",
         "hf generate", "ct2 float32", "ct2 int8")


def write_vocabulary(directory: Path) -> None:
    """sentencepiece.bpe.model (pieces ▁w0..., whole words: unigram, where NLLB's is BPE,
    which segments otherwise but encodes the same way) and tokenizer.json with NLLB's ids."""
    write_word_pieces(directory / "sentencepiece.bpe.model",
                      {"<unk>": 0, "<s>": 1, "</s>": 2}, SPM_PIECES)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = {piece: i for i, piece in enumerate(specials)}
    vocab.update({f"\u2581w{i}": i + 4 for i in range(SPM_PIECES - 3)})
    added = [{"id": i, "content": piece, "special": True} for i, piece in enumerate(specials)]
    added += [{"id": SPM_PIECES + 1 + i, "content": code, "special": True}
              for i, code in enumerate(CODES)]
    added.append({"id": SPM_PIECES + 1 + len(CODES), "content": "<mask>", "special": True})
    (directory / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": added}))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "NllbTokenizer", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn"}))


def write_nllb(directory: Path, shape: dict = SHAPE) -> None:
    """A Hugging Face NLLB directory of nllb-200-distilled-600M's shape (or another),
    random weights."""
    import transformers

    directory.mkdir(parents=True)
    write_vocabulary(directory)
    torch.manual_seed(0)
    config = transformers.M2M100Config(**shape, dropout=0.0, attention_dropout=0.0)
    transformers.M2M100ForConditionalGeneration(config).save_pretrained(directory)


def hugging_face(directory: Path, batches: Batches, new_tokens: int, code: int):
    """transformers' generate on the directory, the target code forced, and after it
    the tokens our import never outputs banned (<s>, pad, the codes, <mask>, the unnamed
    rows), as random weights would otherwise choose them."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.M2M100ForConditionalGeneration.from_pretrained(directory).eval()
    banned = [0, 1] + list(range(SPM_PIECES + 1, SHAPE["vocab_size"]))
    return HuggingFacePeer(model, batches, new_tokens, banned, start=2,
                           forced_bos_token_id=code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser, PEERS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" /
                        "nllb-cpu.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="transduce-nllb-bench-") as scratch:
        run(args, args.work or Path(scratch))


def run(args: argparse.Namespace, work: Path) -> None:
    """Every peer at every beam, interleaved; the results written to args.out."""
    from transduce.decode.translate import Translator

    ours_dir = prepared_models(work)
    translators = {name: Translator.load(ours_dir, dtype=name.split()[1])
                   for name in args.peers if name.startswith("ours")}
    translators.update({name: Translator.load(prepared_onnx(work, name.split()[1]))
                        for name in args.peers if name.startswith("onnx")})
    inputs = Inputs(args, next(iter(translators.values()), None) or Translator.load(ours_dir))
    peers = {name: peer(name, work, translators, inputs, args.new_tokens)
             for name in args.peers}

    def compare(beam: int, outputs: dict, equal: dict) -> None:
        if beam == 1 and "hf generate" in outputs and "ours float32" in outputs:
            equal["ours float32 = hf generate, greedy"] = \
                [inputs.theirs(o) for o in outputs["ours float32"]] == outputs["hf generate"]
        if "onnx float32" in outputs and "ours float32" in outputs:
            equal[f"onnx float32 = ours float32, beam {beam}"] = \
                outputs["onnx float32"] == outputs["ours float32"]

    results = every_beam(args, peers, compare)
    results.update({"machine": machine_info(torch.get_num_threads()), "shape": SHAPE,
                    "sentences": args.sentences, "batch_sentences": args.batch_sentences,
                    "source_tokens": inputs.batches.source_tokens, "new_tokens": args.new_tokens,
                    "repeats": args.repeats})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


def prepared_models(work: Path) -> Path:
    """The Hugging Face directory and its import under `work` (kept between runs) ->
    the import's directory."""
    from transduce.importers import import_nllb

    hf_dir, ours_dir = prepared_hf(work), work / "ours"
    if not (ours_dir / "config.json").is_file():
        import_nllb(hf_dir, ours_dir)
    return ours_dir


def prepared_onnx(work: Path, quantization: str) -> Path:
    """The ONNX export of the import under `work`, written if it is not there."""
    from transduce.export.onnx import export_onnx

    export = work / f"onnx-{quantization}"
    if not (export / "onnx.json").is_file():
        export_onnx(work / "ours", export, None if quantization == "float32" else quantization)
    return export


def prepared_hf(work: Path, shape: dict = SHAPE) -> Path:
    """The Hugging Face directory under `work`, written if it is not there."""
    hf_dir = work / "hf"
    if not (hf_dir / "config.json").is_file():
        write_nllb(hf_dir, shape)
    return hf_dir


class Inputs:
    """The same random sentences (one piece a word) for every peer: our batches of ids,
    transformers' (NLLB's ids), CTranslate2's (pieces)."""

    def __init__(self, args: argparse.Namespace, translator):
        self.codes, self.tokenizer = translator.language_codes, translator.tokenizer
        source = translator.encode(random_lines(args, SPM_PIECES - 3),
                                   prefix=[self.codes["eng_Latn"]])
        their_source = torch.tensor([[SPM_PIECES + 1] + self.theirs(ids[1:]) + [2]
                                     for ids in source])              # eng_Latn ... </s>
        self.batches = Batches(args, self.tokenizer, source, their_source)   # code ... eos

    def theirs(self, ids: list[int]) -> list[int]:
        """Our ids of pieces ▁wN -> NLLB's (the SentencePiece id N + 3, plus fairseq's 1)."""
        return [int(self.tokenizer.piece(i)[2:]) + 4 for i in ids]


def peer(name: str, work: Path, translators: dict, inputs: Inputs, new_tokens: int):
    """call(beam, outputs, name) of one peer: decodes every batch into outputs[name];
    CTranslate2's returns the seconds its child process timed."""
    code = inputs.codes["fra_Latn"]
    if name.startswith(("ours", "onnx")):
        return our_peer(translators[name], inputs.batches, new_tokens, code)
    if name == "hf generate":
        return hugging_face(work / "hf", inputs.batches, new_tokens, SPM_PIECES + 2)  # fra
    return ct2_peer(work / "ours", work, name.split()[1], inputs.batches, new_tokens,
                    inputs.tokenizer.piece(code))


if __name__ == "__main__":
    main()
