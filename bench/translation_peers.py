"""What the benchmarks of imported translation models (nllb.py, t5.py) share: the same
sentences batched for every peer, our searches, CTranslate2 in a child process that
times itself (loaded beside PyTorch, it slows it), and every peer at every beam,
interleaved, with the tokens each wrote.

    python bench/translation_peers.py --ct2-worker EXPORT --job JOB.json   (internal)
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
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import time_interleaved  # noqa: E402


def add_run_options(parser: argparse.ArgumentParser, peers: tuple[str, ...]) -> None:
    """The options every such benchmark takes."""
    parser.add_argument("--sentences", type=int, default=16)
    parser.add_argument("--batch-sentences", type=int, default=8)
    parser.add_argument("--words", type=int, default=20, help="source words per sentence")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers", nargs="+", default=list(peers), choices=peers)
    parser.add_argument("--work", type=Path, default=None,
                        help="where the models are written (default: a temporary directory)")


def random_lines(args: argparse.Namespace, words: int) -> list[str]:
    """args.sentences lines of args.words random words w0 ... w{words - 1}, the same on
    every run (one piece each in the benchmarks' vocabularies)."""
    generator = torch.Generator().manual_seed(1)
    drawn = torch.randint(0, words, (args.sentences, args.words), generator=generator)
    return [" ".join(f"w{int(w)}" for w in row) for row in drawn]


def write_word_pieces(path: Path, specials: dict[str, int], size: int) -> None:
    """A unigram SentencePiece model of `size` pieces at `path`: the special pieces (name
    -> id: <pad>, <s>, </s> or <unk>, the rest of their ids -1) first, in their ids'
    order, then whole words ▁w0, ▁w1, ... ranked by score, so that "w7 w3" is two pieces
    (a BPE model would need merges from characters to reach them)."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    model = model_pb2.ModelProto()
    kinds = model_pb2.ModelProto.SentencePiece
    for piece in sorted(specials, key=specials.get):
        entry = model.pieces.add()
        entry.piece, entry.score = piece, 0.0
        entry.type = kinds.UNKNOWN if piece == "<unk>" else kinds.CONTROL
    for i in range(size - len(specials)):
        entry = model.pieces.add()
        entry.piece, entry.type, entry.score = f"\u2581w{i}", kinds.NORMAL, -float(i)
    spec = model.trainer_spec
    spec.model_type, spec.vocab_size = model_pb2.TrainerSpec.UNIGRAM, size
    spec.pad_id, spec.bos_id, spec.eos_id, spec.unk_id = (
        specials.get(name, -1) for name in ("<pad>", "<s>", "</s>", "<unk>"))
    model.normalizer_spec.add_dummy_prefix = True
    model.normalizer_spec.remove_extra_whitespaces = True
    path.write_bytes(model.SerializeToString())


class Batches:
    """The same sentences for every peer, in batches of args.batch_sentences: ours
    (right-padded ids), transformers' (their ids, one tensor per batch) and CTranslate2's
    (pieces)."""

    def __init__(self, args: argparse.Namespace, tokenizer, source: list[list[int]],
                 their_source: torch.Tensor):
        from transduce.decode.translate import pad_sources

        cut = [slice(i, i + args.batch_sentences)
               for i in range(0, args.sentences, args.batch_sentences)]
        self.source_tokens = len(source[0]) + 1                          # eos included
        self.ours = [pad_sources(source[part]) for part in cut]
        self.their_ids = [their_source[part] for part in cut]
        self.pieces = [[[tokenizer.piece(t) for t in ids] for ids in source[part]]
                       for part in cut]


def our_outputs(translator, batches: list[torch.Tensor], beam: int, new_tokens: int,
                code: int | None) -> list[list[int]]:
    """The searches the Translator runs (greedy_hypotheses at beam 1, else beam_search),
    on its decoding copy, batch by batch, the code given (None: none) -> token ids per
    sentence."""
    from transduce.data.tokenizer import BOS_ID, EOS_ID
    from transduce.decode.greedy import greedy_hypotheses
    from transduce.decode.search import beam_search

    outputs = []
    for src in batches:
        forced = None if code is None else torch.full((src.shape[0], 1), code)
        with torch.inference_mode():
            if beam == 1:
                found = greedy_hypotheses(translator.model, src, bos_id=BOS_ID, eos_id=EOS_ID,
                                          alpha=0.0, max_len=new_tokens, forced=forced)
            else:
                found = beam_search(translator.model, src, bos_id=BOS_ID, eos_id=EOS_ID,
                                    beam=beam, alpha=0.0, max_len=new_tokens, forced=forced)
        outputs += [hypotheses[0].tokens for hypotheses in found]
    return outputs


def our_peer(translator, batches: Batches, new_tokens: int, code: int | None = None):
    """call(beam, outputs, name) of our Translator: its outputs into outputs[name]."""
    return lambda beam, outputs, name: outputs.__setitem__(
        name, our_outputs(translator, batches.ours, beam, new_tokens, code))


class HuggingFacePeer:
    """transformers' generate on `model`, the `banned` ids never output once the first
    `start` tokens (the decoder's start, a forced language code) are there, as our
    imports never output them and random weights would otherwise choose them; `options`
    go to generate. call(beam, outputs, name) puts its outputs, after those `start`
    tokens and without pad and eos, into outputs[name]."""

    def __init__(self, model, batches: Batches, new_tokens: int, banned: list[int], *,
                 start: int = 1, **options):
        import transformers

        self.model, self.batches, self.new_tokens = model, batches, new_tokens
        self.start, self.options = start, options
        self.ends = (model.config.pad_token_id, model.config.eos_token_id)

        class Banned(transformers.LogitsProcessor):
            def __call__(self, input_ids, scores):
                if input_ids.shape[1] >= start:
                    scores[:, banned] = float("-inf")
                return scores

        self.processors = transformers.LogitsProcessorList([Banned()])

    def __call__(self, beam: int, outputs: dict, name: str) -> None:
        found = []
        for src in self.batches.their_ids:
            with torch.inference_mode():
                generated = self.model.generate(
                    input_ids=src, attention_mask=(src != self.ends[0]).long(),
                    num_beams=beam, do_sample=False,
                    max_new_tokens=self.new_tokens + self.start - 1,
                    logits_processor=self.processors,
                    **({"length_penalty": 0.0} if beam > 1 else {}), **self.options)
            found += [[t for t in row[self.start:] if t not in self.ends]
                      for row in generated.tolist()]
        outputs[name] = found


def ct2_peer(ours_dir: Path, work: Path, quantization: str, batches: Batches,
             new_tokens: int, prefix: str | None = None):
    """call(beam, outputs, name) of CTranslate2 on our export (written under `work` if it
    is not there), the target starting with `prefix`: returns its child's seconds."""
    from transduce.export import export_ctranslate2

    export = work / f"ct2-{quantization}"
    if not (export / "model.bin").is_file():
        export_ctranslate2(ours_dir, export, None if quantization == "float32" else quantization)

    def ct2(beam: int, outputs: dict, name: str) -> float:
        outputs[name], seconds = ct2_call(export, batches.pieces, prefix, beam, new_tokens,
                                          torch.get_num_threads())
        return seconds
    return ct2


def ct2_call(export: Path, pieces: list[list[list[str]]], prefix: str | None, beam: int,
             new_tokens: int, threads: int) -> tuple[list[list[str]], float]:
    """CTranslate2 in a child process, the target starting with `prefix` (None: nothing)
    -> (outputs after it, seconds)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"batches": pieces, "prefix": prefix, "beam": beam, "new": new_tokens,
                   "threads": threads}, handle)
    try:
        done = subprocess.run([sys.executable, __file__, "--ct2-worker", str(export),
                               "--job", handle.name], capture_output=True, text=True,
                              check=True)
    finally:
        Path(handle.name).unlink()
    answer = json.loads(done.stdout.splitlines()[-1])
    return answer["outputs"], answer["seconds"]


def ct2_worker(export: Path, job: Path) -> None:
    """Child process: load, warm up on every batch, time every batch; print JSON."""
    import ctranslate2

    task = json.loads(job.read_text())
    translator = ctranslate2.Translator(str(export), device="cpu",
                                        intra_threads=task["threads"])
    prefix = task["prefix"]

    def run() -> list[list[str]]:
        outputs = []
        for batch in task["batches"]:
            found = translator.translate_batch(
                batch, target_prefix=[[prefix]] * len(batch) if prefix else None,
                beam_size=task["beam"], max_decoding_length=task["new"] + bool(prefix),
                length_penalty=0.0)
            outputs += [result.hypotheses[0][bool(prefix):] for result in found]
        return outputs

    run()
    start = time.perf_counter()
    outputs = run()
    print(json.dumps({"outputs": outputs, "seconds": time.perf_counter() - start}))


def every_beam(args: argparse.Namespace, peers: dict[str, Callable],
               compare: Callable[[int, dict, dict], None]) -> dict:
    """Every peer at every beam of args.beams, interleaved over args.repeats rounds ->
    {"peers": seconds, tokens and tokens/s per beam, "outputs_equal": what
    compare(beam, outputs, equal) records}."""
    results: dict = {"peers": {}, "outputs_equal": {}}
    for beam in args.beams:
        outputs: dict[str, list] = {}
        calls = {name: functools.partial(call, beam, outputs, name)
                 for name, call in peers.items()}
        times = time_interleaved(calls, args.repeats)
        record(results, beam, times, outputs, args.sentences * args.new_tokens)
        compare(beam, outputs, results["outputs_equal"])
    return results


def record(results: dict, beam: int, times: dict, outputs: dict, tokens: int) -> None:
    """Each peer's seconds, tokens and tokens/s at this beam, printed and kept."""
    for name, seconds in times.items():
        count = sum(len(o) for o in outputs[name])
        rate = count / statistics.median(seconds)
        results["peers"].setdefault(name, {})[f"beam{beam}"] = {
            "seconds": seconds, "tokens": count, "tokens_per_s": rate}
        if count != tokens:
            print(f"warning: {name} wrote {count} tokens, not {tokens}")
        print(f"beam {beam}  {name:20s} {rate:8.1f} tokens/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ct2-worker", type=Path, required=True)
    parser.add_argument("--job", type=Path, required=True)
    arguments = parser.parse_args()
    ct2_worker(arguments.ct2_worker, arguments.job)
