"""An NLLB or mBART-50 model (imported, then fine-tuned here) or an M2M-100 import ->
transformers' M2M100ForConditionalGeneration with NllbTokenizer's or M2M100Tokenizer's
files, or MBartForConditionalGeneration with MBart50Tokenizer's: every weight is set,
the tokenizer gives our ids in the original's numbering, the logits and the translations
with the target forced are ours, the export imports back to the same translations, and
what M2M100 cannot hold is refused by name with nothing written."""

import json
import shutil
import warnings

import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file, save_file

from transduce import checkpoint
from transduce.cli import main
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from transduce.decode.greedy import greedy_hypotheses
from transduce.decode.search import beam_search
from transduce.decode.translate import Translator, pad_sources
from transduce.export.common import ExportError
from transduce.export.hf import export_hf
from transduce.importers import import_mbart, import_nllb
from transduce.model import load_model
from tests.test_import_mbart import mbart  # noqa: F401
from tests.test_import_nllb import CODES, SAMPLES, TEXT, nllb, write_m2m100  # noqa: F401

transformers = pytest.importorskip("transformers")

THEIR_NAMES = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>", UNK_ID: "<unk>"}


def _tuned(imported, root, corpus_files, source, target):
    """(the import, the import fine-tuned for 4 steps on source -> target, its export)."""
    corpus = root / "corpus"
    corpus.mkdir()
    for file in corpus_files.iterdir():
        if file.is_file() and not file.name.startswith("spm."):
            shutil.copyfile(file, corpus / file.name)
    assert main(["train", "--data", str(corpus), "--init", str(imported), "--out",
                 str(root / "run"), "--max-steps", "4", "--eval-every", "4",
                 "--max-tokens", "512", "--dev-bleu-sentences", "4", "--source-lang",
                 source, "--target-lang", target]) == 0
    run = checkpoint.resolve(root / "run")
    return imported, run, export_hf(run, root / "hf")


@pytest.fixture(scope="module")
def tuned(nllb, tmp_path_factory, tiny_corpus):
    """NLLB's import fine-tuned on spa_Latn -> eng_Latn (_tuned)."""
    return _tuned(nllb[3], tmp_path_factory.mktemp("tuned"), tiny_corpus, "spa_Latn",
                  "eng_Latn")


@pytest.fixture(scope="module")
def tuned_mbart(mbart, tmp_path_factory, tiny_corpus):
    """mBART-50's import fine-tuned on es_XX -> en_XX (_tuned)."""
    return _tuned(mbart[3], tmp_path_factory.mktemp("tuned-mbart"), tiny_corpus, "es_XX",
                  "en_XX")


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory):
    """(M2M-100's tokenizer, its import, the import's export)."""
    root = tmp_path_factory.mktemp("m2m100")
    directory, tokenizer = write_m2m100(root / "m2m100")
    imported = import_nllb(directory, root / "ours")
    return tokenizer, imported, export_hf(imported, root / "hf")


@pytest.fixture(params=["nllb", "m2m100", "mbart"])
def exported(request, nllb, tuned, m2m100, mbart, tuned_mbart):
    """(the original's tokenizer, our checkpoint, its export, source code, two targets)."""
    if request.param == "nllb":
        return nllb[2], tuned[1], tuned[2], "eng_Latn", ("fra_Latn", "eng_Latn")
    if request.param == "mbart":
        return mbart[2], tuned_mbart[1], tuned_mbart[2], "en_XX", ("fr_XX", "en_XX")
    return m2m100[0], m2m100[1], m2m100[2], "en", ("de", "ja")


def _load(directory, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory, **options)
        model = (model[0].eval(), *model[1:]) if isinstance(model, tuple) else model.eval()
        return model, transformers.AutoTokenizer.from_pretrained(directory)


def _their_ids(ours: Tokenizer, theirs, codes) -> list[int]:
    """Per id of ours, the export's id of the same token: a code's is its piece without
    the word boundary (eng_Latn, __en__); -1 for the import's <s>, whose row the
    export's <s> does not take: our bos's does."""
    ids = []
    for i in range(ours.vocab_size):
        piece = THEIR_NAMES.get(i, ours.piece(i))
        piece = piece.removeprefix("\u2581") if i in codes.values() else piece
        ids.append(-1 if piece == "<s>" and i != BOS_ID else theirs.convert_tokens_to_ids(piece))
    return ids


def test_every_weight_is_set(exported):
    (model, info), _ = _load(exported[2], output_loading_info=True)
    assert not any(info.values()), info
    family = "MBart" if exported[3] == "en_XX" else "M2M100"
    assert type(model).__name__ == f"{family}ForConditionalGeneration"
    assert model.config.decoder_start_token_id == 0 and model.config.pad_token_id == 1
    ours = load_model(exported[1])
    assert torch.equal(model.model.shared.weight[0], ours.encoder.embed.embedding.weight[BOS_ID])


def test_training_kept_the_output_bias_and_parted_bos_from_eos(tuned):
    """NLLB's decoder starts from eos, whose row fine-tuning parts from our bos's: the
    export's starts from <s>, which holds our bos's."""
    before, after = load_model(tuned[0]), load_model(tuned[1])
    assert torch.equal(after.output_proj.bias, before.output_proj.bias)
    embedding = after.encoder.embed.embedding.weight
    assert not torch.equal(embedding[BOS_ID], embedding[EOS_ID])
    assert not torch.equal(embedding, before.encoder.embed.embedding.weight)


def test_the_tokenizer_gives_our_ids_numbered_as_the_originals(exported):
    original, run, out, source, _ = exported
    ours, (_, theirs) = Tokenizer(run / checkpoint.TOKENIZER), _load(out)
    codes = load_model(run).language_codes
    to_theirs = _their_ids(ours, theirs, codes)
    for code in codes:
        theirs.src_lang = code
        for text in SAMPLES + TEXT:
            expected = [codes[code]] + ours.encode([text])[0] + [EOS_ID]
            assert theirs(text)["input_ids"] == [to_theirs[i] for i in expected], text
    theirs.src_lang = original.src_lang = source
    for text in SAMPLES + TEXT:   # the codes' ids aside (this NLLB's files put <mask> first)
        assert theirs(text)["input_ids"][1:] == original(text)["input_ids"][1:], text


def test_nllbs_pieces_codes_and_mask_are_numbered_as_sentencepiece_would(tuned):
    """As SentencePiece's NllbTokenizer numbers them: fairseq's offset of 1, then the
    codes, then <mask>; and the recorded pair is the tokenizer's default."""
    _, theirs = _load(tuned[2])
    assert theirs.src_lang == "spa_Latn" and theirs.tgt_lang == "eng_Latn"
    processor = spm.SentencePieceProcessor(model_file=str(tuned[2] / "sentencepiece.bpe.model"))
    size = processor.get_piece_size()
    assert theirs.convert_tokens_to_ids(CODES + ["<mask>"]) == list(
        range(size + 1, size + 2 + len(CODES)))
    for text in SAMPLES + TEXT:
        assert theirs(text)["input_ids"][1:-1] == [i + 1 for i in processor.encode(text)]


def test_logits_are_ours_over_every_token_it_may_output(exported):
    _, run, out, source, targets = exported
    model, ours = load_model(run), Tokenizer(run / checkpoint.TOKENIZER)
    src = pad_sources([[model.language_codes[source]] + ids for ids in ours.encode(SAMPLES)])
    theirs, tokenizer = _load(out)
    to_theirs = torch.tensor(_their_ids(ours, tokenizer, model.language_codes))
    tokenizer.src_lang = source
    encoded = tokenizer(SAMPLES, padding=True, return_tensors="pt")
    torch.manual_seed(1)
    tgt = torch.cat([torch.full((len(SAMPLES), 1), BOS_ID), torch.full(
        (len(SAMPLES), 1), model.language_codes[targets[0]]),
        torch.randint(5, 110, (len(SAMPLES), 6))], dim=1)
    with torch.no_grad():
        expected = theirs(**encoded, decoder_input_ids=to_theirs[tgt]).logits
        found = model(src, tgt)
    banned = {row[0] for row in theirs.generation_config.bad_words_ids}
    kept = [i for i, n in enumerate(to_theirs.tolist()) if n >= 0 and n not in banned]
    # all but pad, bos, the import's <s> (and NLLB's <mask>) and the codes
    assert len(kept) == ours.vocab_size - 3 - ("<mask>" in tokenizer.get_vocab()) - len(
        model.language_codes)
    torch.testing.assert_close(found[..., kept], expected[..., to_theirs[kept]], rtol=1e-5,
                               atol=1e-5)


def test_generate_gives_our_translations_with_the_target_forced(exported):
    """With the export's own generation_config (its bad_words_ids), and no length penalty,
    by which both rank finished beams by log-probability."""
    _, run, out, source, targets = exported
    texts = SAMPLES + TEXT
    model, ours = load_model(run), Tokenizer(run / checkpoint.TOKENIZER)
    src = pad_sources([[model.language_codes[source]] + ids for ids in ours.encode(texts)])
    theirs, tokenizer = _load(out)
    to_theirs = _their_ids(ours, tokenizer, model.language_codes)
    tokenizer.src_lang = source
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    banned = {row[0] for row in theirs.generation_config.bad_words_ids}
    for target in targets:
        forced = torch.full((len(texts), 1), model.language_codes[target])
        forced_code = to_theirs[model.language_codes[target]]
        for beam in (1, 3):
            with torch.no_grad():
                generated = theirs.generate(**encoded, forced_bos_token_id=forced_code,
                                            num_beams=beam, length_penalty=0.0,
                                            max_new_tokens=13, do_sample=False)
            expected = [[t for t in row[2:] if t != tokenizer.pad_token_id]
                        for row in generated.tolist()]
            found = beam_search(model, src, bos_id=BOS_ID, eos_id=EOS_ID, beam=beam,
                                alpha=0.0, max_len=12, forced=forced) if beam > 1 else \
                greedy_hypotheses(model, src, bos_id=BOS_ID, eos_id=EOS_ID, alpha=0.0,
                                  max_len=12, forced=forced)
            assert [[to_theirs[t] for t in h[0].tokens] + [EOS_ID] * (len(e) > len(h[0].tokens))
                    for h, e in zip(found, expected)] == expected
            assert len({t for row in expected for t in row}) > 3
        # which the bad words make ours: without them, transformers outputs a token ours
        # never does
        with torch.no_grad():
            unbanned = theirs.generate(**encoded, forced_bos_token_id=forced_code,
                                       num_beams=1, max_new_tokens=13, do_sample=False,
                                       bad_words_ids=None)
        assert banned & set(unbanned[:, 2:].flatten().tolist())


def test_the_export_imports_back_to_the_same_translations(exported, tmp_path):
    _, run, out, source, targets = exported
    importer = import_mbart if source == "en_XX" else import_nllb
    back = importer(out, tmp_path / "back")
    for target in targets:
        translations = [Translator.load(path).translate(SAMPLES, beam=3, source_lang=source,
                                                        target_lang=target)
                        for path in (run, back)]
        assert translations[0] == translations[1]
    assert checkpoint.read_languages(back) == checkpoint.read_languages(run)


def test_the_command_writes_it(tuned, tmp_path):
    assert main(["export", "hf", str(tuned[1]), str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(
        p.name for p in tuned[2].iterdir())


def test_a_trained_output_bias_is_refused_by_name(tuned, tmp_path):
    directory = tmp_path / "trained"
    shutil.copytree(tuned[1], directory)
    weights = load_file(str(directory / checkpoint.WEIGHTS))
    weights["output_proj.bias"][10] = 0.5
    save_file(weights, str(directory / checkpoint.WEIGHTS))
    with pytest.raises(ExportError, match=r"output_proj.bias varies over the tokens the model "
                                          r"outputs \(from 0 to 0.5\)"):
        export_hf(directory, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".tmp-*"))


def test_codes_neither_tokenizer_names_are_refused_by_name(tuned, tmp_path):
    directory = tmp_path / "renamed"
    shutil.copytree(tuned[1], directory)
    values = json.loads((directory / checkpoint.CONFIG).read_text())
    values["language_codes"]["english"] = values["language_codes"].pop("eng_Latn")
    (directory / checkpoint.CONFIG).write_text(json.dumps(values))
    with pytest.raises(ExportError, match="language code 'english' is the piece 'eng_Latn', "
                                          "which neither NllbTokenizer"):
        export_hf(directory, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
