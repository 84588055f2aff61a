"""Hugging Face mBART-50 -> our checkpoint: the imported model computes what
transformers' MBartForConditionalGeneration computes (logits, greedy and beam
translations with the target language forced), its tokenizer gives MBart50Tokenizer's
ids with the source language first, it translates, fine-tunes and exports to ONNX and
CTranslate2 between the languages named (to transformers: tests/test_export_nllb.py),
and mBART-25 and damaged directories are refused by name with nothing written."""

import json
import shutil
import warnings

import pytest
import sentencepiece as spm
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.data.tokenizer import MODEL_NAME, Tokenizer
from transduce.decode.translate import Translator
from transduce.importers import ForeignCheckpointError, import_mbart
from transduce.importers.hf_mbart import LANGUAGES
from transduce.model import load_model
from tests.test_import_nllb import SAMPLES, TEXT, Languages, assert_ids_follow_the_source_code, \
    assert_logits_match, assert_searches_match

transformers = pytest.importorskip("transformers")


def write_mbart(directory, tokenizer_class="MBart50Tokenizer", **config_changes):
    """A small random mBART-50 directory (MBart weights, MBart50Tokenizer's files) ->
    (directory, its tokenizer)."""
    directory.mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT * 20), minloglevel=2,
                                   model_prefix=str(directory / "sentencepiece.bpe"),
                                   vocab_size=120, model_type="unigram",     # as mBART's
                                   hard_vocab_limit=False)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "MBart50Tokenizer", "src_lang": "en_XX", "tgt_lang": "ro_RO"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = transformers.MBart50Tokenizer.from_pretrained(
            directory, src_lang="en_XX", tgt_lang="ro_RO")
        tokenizer.save_pretrained(directory)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        settings | {"tokenizer_class": tokenizer_class}))
    values = dict(vocab_size=len(tokenizer), d_model=32, encoder_layers=2,
                  decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                  decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0,
                  activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    values.update(config_changes)
    torch.manual_seed(8)
    model = transformers.MBartForConditionalGeneration(transformers.MBartConfig(**values))
    with torch.no_grad():   # away from the initialisation: outputs that vary and end
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(0.3 * torch.randn_like(parameter))
            elif name.endswith("proj.weight") or ".fc" in name or "positions" in name:
                parameter.normal_(0.0, 1.0)
        embedding = model.model.shared.weight.normal_(0.0, 0.3)
        eos = embedding[values["eos_token_id"]]
        model.model.decoder.layer_norm.bias.add_(3.0 * eos / eos.norm())
    model.save_pretrained(directory)
    return directory, tokenizer


@pytest.fixture(scope="module")
def mbart(tmp_path_factory):
    """(the mBART directory, its model, its tokenizer, our import)."""
    root = tmp_path_factory.mktemp("mbart")
    directory, tokenizer = write_mbart(root / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.MBartForConditionalGeneration.from_pretrained(directory).eval()
    return directory, theirs, tokenizer, import_mbart(directory, root / "ours")


MBART = Languages("en_XX", LANGUAGES, options={"forced_eos_token_id": None})


def test_the_tokenizer_gives_mbart50s_ids_after_the_source_language(mbart):
    assert_ids_follow_the_source_code(mbart, MBART)
    assert sorted(load_model(mbart[3]).language_codes) == sorted(LANGUAGES)


def test_logits_match_over_every_token_it_may_output(mbart):
    assert load_model(mbart[3]).config.embedding_norm
    assert load_model(mbart[3]).config.activation == "gelu"
    assert_logits_match(mbart, "fr_XX", MBART)


@pytest.mark.parametrize("target", ["fr_XX", "ro_RO"])
def test_greedy_and_beam_outputs_are_transformers_with_the_target_forced(mbart, target):
    assert_searches_match(mbart, target, MBART)


def test_the_command_and_the_library_translate_between_the_languages_named(mbart, tmp_path,
                                                                           capsys):
    translator = Translator.load(mbart[3])
    french = translator.translate(SAMPLES, beam=2, source_lang="en_XX", target_lang="fr_XX")
    assert french != translator.translate(SAMPLES, beam=2, target_lang="ro_RO")
    assert translator.translate(SAMPLES, beam=2) == translator.translate(
        SAMPLES, beam=2, target_lang="ro_RO")                # tokenizer_config.json's pair
    assert [translator.translate([s], beam=2, target_lang="fr_XX")[0] for s in SAMPLES] \
        == french
    assert translator.decodes_continuously
    source = tmp_path / "in.txt"
    source.write_text("\n".join(SAMPLES) + "\n", encoding="utf-8")
    assert main(["translate", "--model", str(mbart[3]), "--input", str(source), "--beam", "2",
                 "--target-lang", "fr_XX", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.splitlines() == french


def test_fine_tuning_trains_the_embeddings_norm_and_keeps_the_codes(mbart, tmp_path,
                                                                     tiny_corpus):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for file in tiny_corpus.iterdir():
        if file.is_file() and not file.name.startswith("spm."):
            (corpus / file.name).write_bytes(file.read_bytes())
    assert main(["train", "--data", str(corpus), "--init", str(mbart[3]), "--max-steps", "3",
                 "--eval-every", "3", "--save-every", "3", "--max-tokens", "512",
                 "--out", str(tmp_path / "run"), "--source-lang", "es_XX",
                 "--target-lang", "en_XX"]) == 0
    tuned, imported = load_model(checkpoint.resolve(tmp_path / "run")), load_model(mbart[3])
    assert tuned.config.embedding_norm and tuned.language_codes == imported.language_codes
    for stack in ("encoder", "decoder"):
        before = getattr(imported, stack).embed.norm.weight
        assert not torch.equal(getattr(tuned, stack).embed.norm.weight, before)
    assert checkpoint.read_languages(checkpoint.resolve(tmp_path / "run")) == ("es_XX", "en_XX")


def test_the_import_command_says_what_it_wrote(mbart, tmp_path, capsys):
    assert main(["import", "hf-mbart", str(mbart[0]), "--out", str(tmp_path / "m")]) == 0
    said = capsys.readouterr().out
    assert "encoder-decoder" in said and "52 languages" in said


def test_the_ctranslate2_export_translates_as_ours(mbart, tmp_path):
    """CTranslate2's layernorm_embedding is the embeddings' norm: the same translations."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    assert main(["export", "ct2", str(mbart[3]), str(out)]) == 0
    pieces = json.loads((out / "transduce-export.json").read_text())["language_code_pieces"]
    ours = Tokenizer(mbart[3] / checkpoint.TOKENIZER)
    sources = [[pieces["en_XX"]] + [ours.piece(i) for i in ids] for ids in ours.encode(SAMPLES)]
    found = ctranslate2.Translator(str(out), device="cpu", intra_threads=1).translate_batch(
        sources, target_prefix=[[pieces["fr_XX"]]] * len(SAMPLES), beam_size=1,
        max_decoding_length=13, min_decoding_length=0)
    texts = [ours.decode([ours.processor.piece_to_id(p) for p in r.hypotheses[0][1:]])
             for r in found]
    assert texts == Translator.load(mbart[3]).translate(SAMPLES, beam=1, max_length=12,
                                                         target_lang="fr_XX")


def test_the_onnx_export_translates_as_ours(mbart, tmp_path):
    """The graphs carry the embeddings' norm: the same translations through ONNX Runtime."""
    pytest.importorskip("onnxruntime")
    from transduce.export.onnx import export_onnx

    exported = export_onnx(mbart[3], tmp_path / "onnx")
    ours = Translator.load(mbart[3]).translate(SAMPLES, beam=2, target_lang="fr_XX")
    assert Translator.load(exported).translate(SAMPLES, beam=2, target_lang="fr_XX") == ours


def test_a_norm_of_the_embeddings_without_mbart_s_codes_is_refused_by_hf_export(tmp_path,
                                                                                tiny_corpus,
                                                                                capsys):
    """export hf writes an mBART-50 import as mBART (tests/test_export_nllb.py); a model of
    ours with embedding_norm and no language codes has no format there."""
    from transduce.config import preset
    from transduce.model import build_model

    model = build_model(preset("tiny", src_vocab_size=300, tgt_vocab_size=300,
                               embedding_norm=True))
    run = tmp_path / "run"
    checkpoint.save(checkpoint.step_dir(run, 1), model, None, tiny_corpus / MODEL_NAME)
    assert main(["export", "hf", str(run), str(tmp_path / "hf")]) != 0
    assert "embedding_norm=True" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_the_nllb_command_names_the_one_that_imports_mbart(mbart, tmp_path):
    from transduce.importers import import_nllb

    with pytest.raises(ForeignCheckpointError, match="model_type='mbart'; only 'm2m_100' "
                       "checkpoints can be imported here: import it with `transduce import "
                       "hf-mbart`"):
        import_nllb(mbart[0], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mbart25_is_refused_by_name_with_nothing_written(tmp_path):
    directory, _ = write_mbart(tmp_path / "hf", tokenizer_class="MBartTokenizer")
    with pytest.raises(ForeignCheckpointError, match="MBartTokenizer.*mBART-25"):
        import_mbart(directory, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "sentencepiece.bpe.model").unlink(), "no sentencepiece.bpe.model"),
    (lambda d: _rewrite_config(d, vocab_size=90), "ids must be distinct and from 0"),
    (lambda d: _rewrite_config(d, activation_function="tanh"), "activation_function"),
    (lambda d: _rewrite_config(d, model_type="bart"), "model_type"),
])
def test_what_it_cannot_import_is_refused_by_name(mbart, tmp_path, damage, message):
    directory = tmp_path / "hf"
    shutil.copytree(mbart[0], directory)
    damage(directory)
    with pytest.raises(ForeignCheckpointError, match=message):
        import_mbart(directory, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _rewrite_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | changes))
