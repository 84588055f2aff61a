"""Separate source and target vocabularies (`transduce vocab --separate`): each side is
segmented by its own SentencePiece model, the model embeds each side with its own matrix
(the target's tied to the output), translations are decoded with the targets' pieces,
and every export (Marian with separate_vocabs, CTranslate2, ONNX) and the Marian import
carry both."""

import json
import shutil
import warnings

import pytest
import torch

from transduce import checkpoint
from transduce.attention_maps import attention_maps
from transduce.cli import main
from transduce.config import preset
from transduce.data.dataset import load_split
from transduce.data.store import open_store
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, TokenizerError, \
    check_vocabularies
from transduce.decode.search import greedy_search
from transduce.decode.translate import Translator
from transduce.model import Transformer, load_model
from tests.conftest import write_word_pairs

# Spanish to Russian: the sides share no letters, so that each vocabulary is its own.
WORDS = {"uno": "один", "dos": "два", "tres": "три", "casa": "дом", "perro": "собака",
         "gato": "кошка", "rojo": "красный", "grande": "большой", "el": "это", "come": "ест"}
SOURCE_SIZE, TARGET_SIZE = 300, 320


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("es-ru")
    write_word_pairs(directory, WORDS, "ru")
    assert main(["vocab", "--data", str(directory), "--size", str(SOURCE_SIZE), "--separate",
                 "--target-size", str(TARGET_SIZE)]) == 0
    return directory


def _lines(corpus, name):
    return (corpus / name).read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """A random post-norm model over both vocabularies, saved with them -> (model, path)."""
    return saved_model(corpus, tmp_path_factory.mktemp("model"))


def saved_model(corpus, directory, **changes):
    """A random `tiny` model with a matrix for each vocabulary (and `changes`), saved in
    `directory` -> (model, path)."""
    torch.manual_seed(3)
    model = Transformer(preset("tiny", src_vocab_size=SOURCE_SIZE, tgt_vocab_size=TARGET_SIZE,
                               tie_embeddings="decoder", **changes)).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a wrong permutation shows
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(0.3 * torch.randn_like(parameter))
        # Outputs of whole pieces rather than bytes (ids 4-259), so that they decode to text.
        model.decoder.embed.embedding.weight[4:260] = 0.0
    return model, checkpoint.save(directory / "ckpt", model, None, corpus / checkpoint.TOKENIZER)


def _sources(tokenizer, texts):
    """Source ids (B, S), eos-ended and padded."""
    ids = [row + [EOS_ID] for row in tokenizer.encode(texts)]
    src = torch.full((len(ids), max(map(len, ids))), PAD_ID)
    for row, values in enumerate(ids):
        src[row, :len(values)] = torch.tensor(values)
    return src


def _greedy_texts(model, tokenizer, texts, max_len):
    found = greedy_search(model, _sources(tokenizer, texts), bos_id=BOS_ID, eos_id=EOS_ID,
                          max_len=max_len)
    return [tokenizer.target_tokenizer.decode(row.tolist()) for row in found]


# The vocabularies --------------------------------------------------------------------


def test_each_side_has_a_vocabulary_of_its_own(corpus):
    tokenizer = Tokenizer(corpus / checkpoint.TOKENIZER)
    target = tokenizer.target_tokenizer
    assert tokenizer.separate and target.path.name == checkpoint.TARGET_TOKENIZER
    assert (tokenizer.vocab_size, target.vocab_size) == (SOURCE_SIZE, TARGET_SIZE)
    source_pieces = {tokenizer.piece(i) for i in range(tokenizer.vocab_size)}
    target_pieces = {target.piece(i) for i in range(target.vocab_size)}
    assert "\u2581perro" in source_pieces and "\u2581perro" not in target_pieces
    assert "\u2581собака" in target_pieces and "\u2581собака" not in source_pieces
    for side, name in ((tokenizer, "train.es"), (target, "train.ru")):
        texts = _lines(corpus, name)
        assert [side.decode(ids) for ids in side.encode(texts)] == texts
    # The other side's words fall back to bytes: the word boundary, then 2 a letter.
    assert len(tokenizer.encode(["собака"])[0]) == 1 + 12 > len(target.encode(["собака"])[0])
    assert tokenizer.fingerprint != Tokenizer(target.path).fingerprint


def test_a_shared_vocabulary_replaces_a_separate_one(corpus, tmp_path):
    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    assert main(["vocab", "--data", str(copy), "--size", "320"]) == 0
    assert not (copy / "spm-target.model").exists() and not (copy / "spm-target.vocab").exists()
    shared = Tokenizer(copy / checkpoint.TOKENIZER)
    assert not shared.separate and shared.target_tokenizer is shared
    assert shared.encode(["perro"]) and shared.encode(["собака"])


def test_a_sample_trains_each_side_on_its_own_texts(corpus, tmp_path):
    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    assert main(["vocab", "--data", str(copy), "--separate", "--sample", "150", "--size", "290",
                 "--target-size", "300"]) == 0
    tokenizer = Tokenizer(copy / checkpoint.TOKENIZER)
    assert (tokenizer.vocab_size, tokenizer.target_tokenizer.vocab_size) == (290, 300)
    cyrillic = [any("\u0400" <= char <= "\u04ff" for char in side.piece(i))
                for side, size in ((tokenizer, 290), (tokenizer.target_tokenizer, 300))
                for i in range(size)]
    assert not any(cyrillic[:290]) and sum(cyrillic[290:]) > 20     # Russian: targets only


@pytest.mark.parametrize("flags, message", [
    (["--target-size", "300"], "--target-size sizes a separate target vocabulary"),
    (["--separate"], "--separate trains a vocabulary for each side of a parallel corpus; "),
])
def test_vocabulary_flags_that_do_not_apply_are_refused(tmp_path, capsys, flags, message):
    (tmp_path / "train.txt").write_text("uno dos tres\n" * 20, encoding="utf-8")
    assert main(["vocab", "--data", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "spm.model").exists()


def test_a_target_vocabulary_too_large_names_its_file_and_writes_nothing(corpus, tmp_path,
                                                                        capsys):
    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    before = {name: (copy / name).read_bytes() for name in ("spm.model", "spm-target.model")}
    assert main(["vocab", "--data", str(copy), "--separate", "--size", "300",
                 "--target-size", "100000"]) == 1
    assert "spm-target.model: SentencePiece could not train a 100000-token vocabulary" in \
        capsys.readouterr().err
    assert {name: (copy / name).read_bytes() for name in before} == before
    assert not list(copy.glob(".tmp-spm-*"))


def test_a_model_is_checked_against_both_vocabularies(corpus):
    tokenizer = Tokenizer(corpus / checkpoint.TOKENIZER)
    check_vocabularies(tokenizer, SOURCE_SIZE, TARGET_SIZE, shared=False)
    with pytest.raises(TokenizerError, match=r"spm-target.model: 320 pieces, but the model "
                                             r"has tgt_vocab_size=300"):
        check_vocabularies(tokenizer, SOURCE_SIZE, SOURCE_SIZE, shared=False)
    with pytest.raises(TokenizerError, match=r"a separate target vocabulary .* shares one "
                                             r"matrix between both sides"):
        check_vocabularies(tokenizer, SOURCE_SIZE, TARGET_SIZE, shared=True)


# Training ------------------------------------------------------------------------------


def test_targets_are_segmented_by_their_vocabulary_as_text_and_as_a_store(corpus, tmp_path):
    tokenizer = Tokenizer(corpus / checkpoint.TOKENIZER)
    split = load_split(corpus, "train", tokenizer)
    assert [list(ids) for ids in split.src_ids] == tokenizer.encode(_lines(corpus, "train.es"))
    assert [list(ids) for ids in split.tgt_ids] == \
        tokenizer.target_tokenizer.encode(_lines(corpus, "train.ru"))
    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    assert main(["data", "tokenize", "--data", str(copy), "--workers", "1"]) == 0
    copied = Tokenizer(copy / checkpoint.TOKENIZER)
    assert open_store(copy, "train", copied.fingerprint) is not None
    stored = load_split(copy, "train", copied)
    assert [list(map(int, ids)) for ids in stored.src_ids] == \
        [list(ids) for ids in split.src_ids]
    assert [list(map(int, ids)) for ids in stored.tgt_ids] == \
        [list(ids) for ids in split.tgt_ids]


def test_training_embeds_each_side_with_its_own_matrix(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(run), "--preset", "tiny",
                 "--max-steps", "2", "--dev-bleu-sentences", "4"]) == 0
    config = json.loads((checkpoint.resolve(run) / "config.json").read_text())["model"]
    assert (config["src_vocab_size"], config["tgt_vocab_size"], config["tie_embeddings"]) == \
        (SOURCE_SIZE, TARGET_SIZE, "decoder")
    assert (checkpoint.resolve(run) / checkpoint.TARGET_TOKENIZER).read_bytes() == \
        (corpus / checkpoint.TARGET_TOKENIZER).read_bytes()
    model = load_model(run)
    assert model.output_proj.weight is model.decoder.embed.embedding.weight
    assert model.encoder.embed.embedding.weight.shape == (SOURCE_SIZE, 64)
    capsys.readouterr()
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "all"),
                 "--preset", "tiny", "--max-steps", "1", "--tie-embeddings", "all"]) == 2
    assert "tie_embeddings='all' needs one shared vocabulary" in capsys.readouterr().err


def test_an_rnn_translates_with_separate_vocabularies(corpus, tmp_path):
    run = tmp_path / "rnn"
    assert main(["train", "--data", str(corpus), "--out", str(run), "--preset", "tiny",
                 "--arch", "rnn-luong", "--max-steps", "2"]) == 0
    model = load_model(run)
    assert model.output_proj.weight is model.tgt_embedding.weight
    assert model.src_embedding.weight.shape[0] == SOURCE_SIZE
    sources = _lines(corpus, "test.es")[:4]
    assert Translator.load(run).translate(sources, beam=1, max_length=8) == \
        _greedy_texts(model.eval(), Tokenizer(corpus / checkpoint.TOKENIZER), sources, 8)


def test_fine_tuning_refuses_a_corpus_with_another_target_vocabulary(corpus, saved, tmp_path,
                                                                    capsys):
    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    shutil.copyfile(copy / "spm.model", copy / checkpoint.TARGET_TOKENIZER)
    assert main(["train", "--data", str(copy), "--out", str(tmp_path / "run"),
                 "--init", str(saved[1]), "--max-steps", "1"]) == 1
    assert "spm-target.model is not the vocabulary" in capsys.readouterr().err


# Decoding ------------------------------------------------------------------------------


def test_translations_are_decoded_with_the_target_vocabulary(corpus, saved):
    model, path = saved
    tokenizer = Tokenizer(corpus / checkpoint.TOKENIZER)
    sources = _lines(corpus, "test.es")[:6]
    found = Translator.load(path).translate(sources, beam=1, max_length=12)
    assert found == _greedy_texts(model, tokenizer, sources, 12)
    assert any(any("\u0400" <= char <= "\u04ff" for char in text) for text in found)


def test_attention_maps_name_target_pieces_from_the_target_vocabulary(corpus, saved):
    translator = Translator.load(saved[1])
    maps = attention_maps(translator, "el perro come", beam=1)
    tokenizer = Tokenizer(corpus / checkpoint.TOKENIZER)
    ids = tokenizer.encode(["el perro come"])[0] + [EOS_ID]
    assert maps.source_tokens == [tokenizer.piece(i) for i in ids]
    assert maps.target_inputs[0] == "<s>"
    output = [piece for piece in maps.target_outputs if piece != "</s>"]
    assert maps.translation == tokenizer.target_tokenizer.processor.decode_pieces(output)
    source_pieces = {tokenizer.piece(i) for i in range(tokenizer.vocab_size)}
    assert any(piece not in source_pieces for piece in output)      # the targets' own


def test_the_server_translates_with_the_target_vocabulary(corpus, saved):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from transduce.serve import create_app

    translator = Translator.load(saved[1])
    sources = _lines(corpus, "test.es")[:3]
    with TestClient(create_app(translator, name="es-ru")) as client:
        models = client.get("/v1/models").json()["data"][0]
        assert (models["vocabulary"]["size"], models["vocabulary"]["target_size"]) == \
            (SOURCE_SIZE, TARGET_SIZE)
        answer = client.post("/v1/translate", json={"texts": sources, "beam": 1,
                                                    "max_length": 12})
    assert answer.status_code == 200
    assert [item["text"] for item in answer.json()["translations"]] == \
        translator.translate(sources, beam=1, max_length=12)


# Exports and the import ----------------------------------------------------------------

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
    from transduce.export import export_hf

    out = export_hf(saved[1], tmp_path_factory.mktemp("hf") / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.MarianMTModel.from_pretrained(out).eval()
        tokenizer = transformers.MarianTokenizer.from_pretrained(out)
    return out, theirs, tokenizer


def test_the_marian_export_has_separate_vocabularies(corpus, exported):
    out, theirs, their_tokenizer = exported
    assert theirs.config.share_encoder_decoder_embeddings is False
    assert (theirs.config.vocab_size, theirs.config.decoder_vocab_size) == \
        (SOURCE_SIZE, TARGET_SIZE)
    assert json.loads((out / "tokenizer_config.json").read_text())["separate_vocabs"] is True
    ours = Tokenizer(corpus / checkpoint.TOKENIZER)
    sources, targets = _lines(corpus, "test.es"), _lines(corpus, "test.ru")
    assert their_tokenizer(sources)["input_ids"] == [ids + [EOS_ID] for ids in ours.encode(sources)]
    assert their_tokenizer(text_target=targets)["input_ids"] == \
        [ids + [EOS_ID] for ids in ours.target_tokenizer.encode(targets)]


def test_the_marian_export_computes_what_we_compute(corpus, saved, exported):
    model, _ = saved
    _, theirs, their_tokenizer = exported
    tokenizer = Tokenizer(corpus / checkpoint.TOKENIZER)
    sources = _lines(corpus, "test.es")[:4]
    src = _sources(tokenizer, sources)
    torch.manual_seed(1)
    tgt = torch.cat([torch.full((4, 1), BOS_ID), torch.randint(4, TARGET_SIZE, (4, 7))], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(
            theirs(input_ids=src, attention_mask=src != PAD_ID, decoder_input_ids=tgt).logits,
            model(src, tgt), rtol=1e-5, atol=1e-5)
        encoded = their_tokenizer(sources, return_tensors="pt", padding=True)
        generated = theirs.generate(**encoded, num_beams=1, do_sample=False, max_new_tokens=12)
    assert their_tokenizer.batch_decode(generated, skip_special_tokens=True) == \
        _greedy_texts(model, tokenizer, sources, 12)


def test_the_marian_export_imports_back_to_the_same_model(corpus, saved, exported, tmp_path):
    from transduce.importers import import_marian

    model, path = saved
    back = import_marian(exported[0], tmp_path / "back")
    for name in (checkpoint.TOKENIZER, checkpoint.TARGET_TOKENIZER):
        again, first = Tokenizer(back / name), Tokenizer(corpus / name)
        assert [again.piece(i) for i in range(again.vocab_size)] == \
            [first.piece(i) for i in range(first.vocab_size)]
    imported = load_model(back)
    assert imported.config.tie_embeddings == "decoder"
    for name in ("encoder.embed.embedding.weight", "decoder.embed.embedding.weight",
                 "decoder.layers.1.cross_attn.k_proj.weight", "encoder.layers.0.norm1.bias"):
        torch.testing.assert_close(imported.get_parameter(name), model.get_parameter(name),
                                   rtol=0, atol=0)
    sources = _lines(corpus, "test.es")
    assert Translator.load(back).translate(sources, beam=4, max_length=12) == \
        Translator.load(path).translate(sources, beam=4, max_length=12)


def test_pegasus_refuses_a_matrix_for_each_side_by_name(corpus, tmp_path):
    from transduce.export import ExportError, export_hf

    _, path = saved_model(corpus, tmp_path, norm_first=True)
    with pytest.raises(ExportError, match=r"Pegasus: tie_embeddings='decoder' \(Pegasus "
                                          r"shares one matrix"):
        export_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_the_onnx_export_carries_both_vocabularies(corpus, saved, tmp_path):
    pytest.importorskip("onnxruntime")
    from transduce.export.onnx import export_onnx

    out = export_onnx(saved[1], tmp_path / "onnx")
    assert (out / checkpoint.TARGET_TOKENIZER).read_bytes() == \
        (corpus / checkpoint.TARGET_TOKENIZER).read_bytes()
    sources = _lines(corpus, "test.es")[:8]
    assert Translator.load(out).translate(sources, beam=2, max_length=12) == \
        Translator.load(saved[1]).translate(sources, beam=2, max_length=12)


@pytest.mark.parametrize("norm_first", [False, True])
def test_the_ctranslate2_export_outputs_target_pieces(corpus, tmp_path, norm_first):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transduce.export import export_ctranslate2

    model, path = saved_model(corpus, tmp_path, norm_first=norm_first)
    out = export_ctranslate2(path, tmp_path / "ct2")
    source, target = (Tokenizer(out / name) for name in (checkpoint.TOKENIZER,
                                                        checkpoint.TARGET_TOKENIZER))
    assert [json.loads((out / f"{side}_vocabulary.json").read_text())[5]
            for side in ("source", "target")] == [source.piece(5), target.piece(5)]
    sources = _lines(corpus, "test.es")[:8]
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    found = translator.translate_batch([[source.piece(i) for i in ids]
                                        for ids in source.encode(sources)],
                                       beam_size=1, max_decoding_length=12,
                                       min_decoding_length=0)
    texts = [target.processor.decode_pieces(result.hypotheses[0]) for result in found]
    assert texts == _greedy_texts(model, Tokenizer(corpus / checkpoint.TOKENIZER), sources, 12)
