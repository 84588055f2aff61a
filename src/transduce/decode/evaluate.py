"""Score translations of a corpus split the way the field does: sacreBLEU (13a) and chrF on
detokenised text, printed with the signature, and a second reference when the data has
one ({split}.ref2, written by `transduce data bible` from the World English Bible)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import sacrebleu

from transduce import atomic
from transduce.data.corpus import CorpusError, read_lines, split_files
from transduce.decode.translate import Translator


def evaluate_split(translator: Translator, data_dir: Path, split: str, out_prefix: Path, *,
                   beam: int = 4, alpha: float = 0.6, batch_tokens: int = 4096,
                   batch_sentences: int = 0, progress=None) -> dict:
    """Translate every line of the split's source, score against its references, and
    write OUT.hyp (one line per source line) and OUT.json (scores, signatures, timing)."""
    source_path, reference_path = split_files(data_dir, split)
    sources, references = read_lines(source_path), read_lines(reference_path)
    second = data_dir / f"{split}.ref2"
    references2 = read_lines(second) if second.is_file() else None
    for path, lines in ((reference_path, references), (second, references2)):
        if lines is not None and len(lines) != len(sources):
            raise CorpusError(f"{path} has {len(lines)} lines but {source_path} has "
                              f"{len(sources)}: references must be line-aligned")
    start = time.perf_counter()
    hypotheses = translator.translate(sources, beam=beam, alpha=alpha, batch_tokens=batch_tokens,
                                      batch_sentences=batch_sentences, progress=progress)
    seconds = time.perf_counter() - start
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    result = {
        "split": split, "sentences": len(sources), "beam": beam, "alpha": alpha,
        "dtype": translator.dtype,
        "bleu": bleu.corpus_score(hypotheses, [references]).score,
        "chrf": chrf.corpus_score(hypotheses, [references]).score,
        "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature()),
        "seconds": seconds, "sentences_per_second": len(sources) / seconds,
    }
    if references2 is not None:
        result["bleu_ref2"] = sacrebleu.metrics.BLEU().corpus_score(hypotheses, [references2]).score
        two = sacrebleu.metrics.BLEU()
        result["bleu_two_references"] = two.corpus_score(hypotheses, [references, references2]).score
    hypothesis_file = atomic.write_text(out_prefix.with_suffix(".hyp"),
                                        "".join(h + "\n" for h in hypotheses))
    result["hypotheses"] = str(hypothesis_file)
    atomic.write_text(out_prefix.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
    return result
