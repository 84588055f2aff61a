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
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, time_interleaved  # noqa: E402

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
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    model = model_pb2.ModelProto()
    kinds = model_pb2.ModelProto.SentencePiece
    for piece, kind in (("<unk>", kinds.UNKNOWN), ("<s>", kinds.CONTROL),
                        ("</s>", kinds.CONTROL)):
        entry = model.pieces.add()
        entry.piece, entry.type, entry.score = piece, kind, 0.0
    for i in range(SPM_PIECES - 3):
        entry = model.pieces.add()
        entry.piece, entry.type, entry.score = f"\u2581w{i}", kinds.NORMAL, -float(i)
    model.trainer_spec.model_type = model_pb2.TrainerSpec.UNIGRAM   # (a BPE model needs
    #                                                 merges from characters to reach ▁wN)
    model.trainer_spec.vocab_size = SPM_PIECES
    model.trainer_spec.unk_id, model.trainer_spec.bos_id = 0, 1
    model.trainer_spec.eos_id, model.trainer_spec.pad_id = 2, -1
    model.normalizer_spec.add_dummy_prefix = True
    model.normalizer_spec.remove_extra_whitespaces = True
    (directory / "sentencepiece.bpe.model").write_bytes(model.SerializeToString())
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


class HuggingFace:
    """transformers' generate on the directory, the target code forced, and after it
    the tokens our import never outputs banned (<s>, pad, the codes, <mask>, the unnamed
    rows), as random weights would otherwise choose them."""

    def __init__(self, directory: Path, code: int):
        import transformers

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = transformers.M2M100ForConditionalGeneration.from_pretrained(
                directory).eval()
        self.code = code
        banned = [0, 1] + list(range(SPM_PIECES + 1, SHAPE["vocab_size"]))

        class AfterTheCode(transformers.LogitsProcessor):
            def __call__(self, input_ids, scores):
                if input_ids.shape[1] > 1:
                    scores[:, banned] = float("-inf")
                return scores

        self.processors = transformers.LogitsProcessorList([AfterTheCode()])

    def __call__(self, batches: list[torch.Tensor], beam: int, new_tokens: int
                 ) -> list[list[int]]:
        outputs = []
        for src in batches:
            with torch.inference_mode():
                generated = self.model.generate(
                    input_ids=src, attention_mask=(src != SHAPE["pad_token_id"]).long(),
                    num_beams=beam, do_sample=False, forced_bos_token_id=self.code,
                    max_new_tokens=new_tokens + 1, logits_processor=self.processors,
                    **({"length_penalty": 0.0} if beam > 1 else {}))
            outputs += [row[2:] for row in generated.tolist()]       # after start and code
        return outputs


def our_outputs(translator, batches: list[torch.Tensor], beam: int, new_tokens: int,
                code: int) -> list[list[int]]:
    """The searches the Translator runs (greedy_hypotheses at beam 1, else beam_search),
    on its decoding copy, batch by batch, the code given -> token ids per sentence."""
    from transduce.data.tokenizer import BOS_ID, EOS_ID
    from transduce.decode.greedy import greedy_hypotheses
    from transduce.decode.search import beam_search

    outputs = []
    for src in batches:
        forced = torch.full((src.shape[0], 1), code)
        with torch.inference_mode():
            if beam == 1:
                found = greedy_hypotheses(translator.model, src, bos_id=BOS_ID, eos_id=EOS_ID,
                                          alpha=0.0, max_len=new_tokens, forced=forced)
            else:
                found = beam_search(translator.model, src, bos_id=BOS_ID, eos_id=EOS_ID,
                                    beam=beam, alpha=0.0, max_len=new_tokens, forced=forced)
        outputs += [hypotheses[0].tokens for hypotheses in found]
    return outputs


def ct2_call(export: Path, pieces: list[list[list[str]]], prefix: str, beam: int,
             new_tokens: int, threads: int) -> tuple[list[list[str]], float]:
    """CTranslate2 in a child process (see the module's note) -> (outputs, seconds)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"batches": pieces, "prefix": prefix, "beam": beam, "new": new_tokens,
                   "threads": threads}, handle)
    done = subprocess.run([sys.executable, __file__, "--ct2-worker", str(export),
                           "--job", handle.name], capture_output=True, text=True, check=True)
    answer = json.loads(done.stdout.splitlines()[-1])
    return answer["outputs"], answer["seconds"]


def ct2_worker(export: Path, job: Path) -> None:
    """Child process: load, warm up on the first batch, time every batch; print JSON."""
    import ctranslate2

    task = json.loads(job.read_text())
    translator = ctranslate2.Translator(str(export), device="cpu",
                                        intra_threads=task["threads"])

    def run() -> list[list[str]]:
        outputs = []
        for batch in task["batches"]:
            found = translator.translate_batch(
                batch, target_prefix=[[task["prefix"]]] * len(batch), beam_size=task["beam"],
                max_decoding_length=task["new"] + 1, length_penalty=0.0)
            outputs += [result.hypotheses[0][1:] for result in found]
        return outputs

    run()
    start = time.perf_counter()
    outputs = run()
    print(json.dumps({"outputs": outputs, "seconds": time.perf_counter() - start}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=16)
    parser.add_argument("--batch-sentences", type=int, default=8)
    parser.add_argument("--words", type=int, default=20, help="source words per sentence")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--work", type=Path, default=None,
                        help="where the models are written (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" /
                        "nllb-cpu.json")
    parser.add_argument("--ct2-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ct2_worker:
        return ct2_worker(args.ct2_worker, args.job)
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
    results: dict = {"peers": {}, "outputs_equal": {}}
    for beam in args.beams:
        outputs: dict[str, list] = {}
        calls = {name: functools.partial(call, beam, outputs, name)
                 for name, call in peers.items()}
        times = time_interleaved(calls, args.repeats)
        record(results, beam, times, outputs, args.sentences * args.new_tokens)
        if beam == 1 and "hf generate" in outputs and "ours float32" in outputs:
            results["outputs_equal"]["ours float32 = hf generate, greedy"] = \
                [inputs.theirs(o) for o in outputs["ours float32"]] == outputs["hf generate"]
        if "onnx float32" in outputs and "ours float32" in outputs:
            results["outputs_equal"][f"onnx float32 = ours float32, beam {beam}"] = \
                outputs["onnx float32"] == outputs["ours float32"]
    results.update({"machine": machine_info(torch.get_num_threads()), "shape": SHAPE,
                    "sentences": args.sentences, "batch_sentences": args.batch_sentences,
                    "source_tokens": inputs.source_tokens, "new_tokens": args.new_tokens,
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
        from transduce.decode.translate import pad_sources

        generator = torch.Generator().manual_seed(1)
        words = torch.randint(0, SPM_PIECES - 3, (args.sentences, args.words),
                              generator=generator)
        lines = [" ".join(f"w{int(w)}" for w in row) for row in words]
        self.codes, self.tokenizer = translator.language_codes, translator.tokenizer
        source = translator.encode(lines, prefix=[self.codes["eng_Latn"]])
        self.source_tokens = len(source[0]) + 1                      # code, words, eos
        their_source = torch.tensor([[SPM_PIECES + 1] + self.theirs(ids[1:]) + [2]
                                     for ids in source])              # eng_Latn ... </s>
        cut = [slice(i, i + args.batch_sentences)
               for i in range(0, args.sentences, args.batch_sentences)]
        self.ours = [pad_sources(source[part]) for part in cut]
        self.their_ids = [their_source[part] for part in cut]
        self.pieces = [[[self.tokenizer.piece(t) for t in ids] for ids in source[part]]
                       for part in cut]

    def theirs(self, ids: list[int]) -> list[int]:
        """Our ids of pieces ▁wN -> NLLB's (the SentencePiece id N + 3, plus fairseq's 1)."""
        return [int(self.tokenizer.piece(i)[2:]) + 4 for i in ids]


def peer(name: str, work: Path, translators: dict, inputs: Inputs, new_tokens: int):
    """call(beam, outputs, name) of one peer: decodes every batch into outputs[name];
    CTranslate2's returns the seconds its child process timed."""
    code = inputs.codes["fra_Latn"]
    if name.startswith(("ours", "onnx")):
        translator = translators[name]
        return lambda beam, outputs, name: outputs.__setitem__(
            name, our_outputs(translator, inputs.ours, beam, new_tokens, code))
    if name == "hf generate":
        hf = HuggingFace(work / "hf", SPM_PIECES + 2)                   # fra_Latn
        return lambda beam, outputs, name: outputs.__setitem__(
            name, hf(inputs.their_ids, beam, new_tokens))
    from transduce.export import export_ctranslate2

    quantization = name.split()[1]
    export = work / f"ct2-{quantization}"
    if not (export / "model.bin").is_file():
        export_ctranslate2(work / "ours", export,
                           None if quantization == "float32" else quantization)

    def ct2(beam: int, outputs: dict, name: str) -> float:
        outputs[name], seconds = ct2_call(export, inputs.pieces, inputs.tokenizer.piece(code),
                                          beam, new_tokens, torch.get_num_threads())
        return seconds
    return ct2


def record(results: dict, beam: int, times: dict, outputs: dict, tokens: int) -> None:
    """Each peer's seconds, tokens and tokens/s at this beam, printed and kept."""
    for name, seconds in times.items():
        count = sum(len(o) for o in outputs[name])
        rate = count / statistics.median(seconds)
        results["peers"].setdefault(name, {})[f"beam{beam}"] = {
            "seconds": seconds, "tokens": count, "tokens_per_s": rate}
        if count != tokens:
            print(f"warning: {name} wrote {count} tokens, not {tokens}")
        print(f"beam {beam}  {name:14s} {rate:8.1f} tokens/s")


if __name__ == "__main__":
    main()
