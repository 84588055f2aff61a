"""Hugging Face NLLB-200 -> our checkpoint: the imported model computes what
transformers' M2M100ForConditionalGeneration computes (logits, greedy and beam
translations with the target language forced), its tokenizer gives NllbTokenizer's ids
with the source language first, the languages are chosen by the command line, the API
and the exports, and what we cannot reproduce is refused by name with nothing written."""

import functools
import json
from dataclasses import dataclass, field
import shutil
import warnings

import pytest
import sentencepiece as spm
import torch
from fastapi.testclient import TestClient

from transduce import checkpoint
from transduce.checkpoint import CheckpointError
from transduce.cli import main
from transduce.config import ConfigError
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transduce.decode.greedy import greedy_hypotheses
from transduce.decode.search import beam_search
from transduce.decode.translate import Translator, pad_sources
from transduce.importers import import_nllb
from transduce.model.positional import fairseq_table
from transduce.model import load_model
from transduce.model.transformer import NEVER_OUTPUT
from tests.foreign_checkpoints import assert_refused, damaged

transformers = pytest.importorskip("transformers")

TEXT = ["The quick brown fox jumps over the lazy dog.", "She sells sea shells by the shore.",
        "How much wood would a woodchuck chuck?", "Peter Piper picked a peck of peppers.",
        "El rápido zorro marrón salta sobre el perro perezoso.",
        "Numbers 12, 345 and 6789; symbols: @#%&*!", "Ünïcödé àéîõü ñ ß café naïve"]
SAMPLES = ["The quick brown fox.", "sea shells by the shore", "café naïve Ünïcödé",
           "Numbers: 12 and 345!", "zzzz qqqq xylophone", "a"]
CODES = ["eng_Latn", "spa_Latn", "fra_Latn"]


def write_nllb(directory, **config_changes):
    """A small random NLLB directory (M2M100 weights, NllbTokenizer files) -> (directory,
    its tokenizer)."""
    directory.mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT * 20), minloglevel=2,
                                   model_prefix=str(directory / "sentencepiece.bpe"),
                                   vocab_size=120, model_type="bpe", hard_vocab_limit=False)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "NllbTokenizer", "src_lang": "eng_Latn", "tgt_lang": "spa_Latn"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            directory, extra_special_tokens=CODES, src_lang="eng_Latn", tgt_lang="spa_Latn")
        tokenizer.save_pretrained(directory)
    values = dict(vocab_size=len(tokenizer) + 2, d_model=32, encoder_layers=2,
                  decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                  decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0,
                  activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    values.update(config_changes)
    torch.manual_seed(8)
    model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**values))
    with torch.no_grad():   # away from the initialisation: outputs that vary and end
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(0.3 * torch.randn_like(parameter))
            elif name.endswith("proj.weight") or ".fc" in name:
                parameter.normal_(0.0, 1.0)
        embedding = model.model.shared.weight.normal_(0.0, 0.3)
        eos = embedding[values["eos_token_id"]]
        model.model.decoder.layer_norm.bias.add_(3.0 * eos / eos.norm())
    model.save_pretrained(directory)
    return directory, tokenizer


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    """(the NLLB directory, its model, its tokenizer, our import)."""
    root = tmp_path_factory.mktemp("nllb")
    directory, tokenizer = write_nllb(root / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.M2M100ForConditionalGeneration.from_pretrained(directory).eval()
    return directory, theirs, tokenizer, import_nllb(directory, root / "ours")


@dataclass(frozen=True)
class Languages:
    """What a multilingual family's checks against transformers read: the source code, the
    codes its tokenizer has, its rows past the tokenizer's ids (NLLB has 2, which no piece
    names), and generate's options (mBART's config forces eos at the length limit)."""

    source: str
    codes: list[str]
    rows_past: int = 0
    options: dict = field(default_factory=dict)


NLLB = Languages("eng_Latn", CODES, rows_past=2)


def nllb_id_of(ours: Tokenizer, theirs, codes=CODES) -> list[int]:
    """Per id of ours, the original's id of the same piece (a code's piece of ours starts
    with the word boundary), -1 for pad and bos."""
    ids = []
    for i in range(ours.vocab_size):
        piece = ours.piece(i)
        piece = piece[1:] if piece[1:] in codes else piece
        ids.append(-1 if i in (PAD_ID, BOS_ID) else theirs.convert_tokens_to_ids(piece))
    return ids


def never_output(theirs, languages=NLLB) -> list[int]:
    """The original's ids that the import never outputs: pad, <s>, <mask>, the codes, and
    the rows past the tokenizer's ids."""
    return theirs.convert_tokens_to_ids(["<pad>", "<s>", "<mask>"] + languages.codes) + \
        [len(theirs) + i for i in range(languages.rows_past)]


class _AfterTheForcedCode(transformers.LogitsProcessor):
    """transformers' search made to skip the tokens ours never outputs, once the forced
    language code is given (suppress_tokens would suppress the code as well)."""

    def __init__(self, banned):
        self.banned = banned

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > 1:
            scores[:, self.banned] = float("-inf")
        return scores


def _their_outputs(imported, texts, target, languages=NLLB, **options):
    """transformers' generate into `target` -> ids after the start and the code (12 at
    most: its max_new_tokens counts the code). The banned tokens' share is taken out of
    the probabilities (renormalize_logits), as our never-output bias does, so that beams
    are ranked as ours."""
    _, theirs, tokenizer, _ = imported
    tokenizer.src_lang = languages.source
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    processors = transformers.LogitsProcessorList(
        [_AfterTheForcedCode(never_output(tokenizer, languages))])
    with torch.no_grad():
        out = theirs.generate(**encoded, forced_bos_token_id=tokenizer.convert_tokens_to_ids(
            target), do_sample=False, max_new_tokens=13, logits_processor=processors,
            renormalize_logits=True, **languages.options, **options)
    return [[t for t in row[2:] if t != tokenizer.pad_token_id] for row in out.tolist()]


def _our_source(out, texts, source="eng_Latn"):
    model, ours = load_model(out), Tokenizer(out / checkpoint.TOKENIZER)
    return model, ours, pad_sources([[model.language_codes[source]] + ids
                                     for ids in ours.encode(texts)])


def assert_ids_follow_the_source_code(imported, languages=NLLB):
    """Our ids, mapped to the original's, are its tokenizer's with the source code first."""
    _, _, theirs, out = imported
    to_theirs = nllb_id_of(Tokenizer(out / checkpoint.TOKENIZER), theirs, languages.codes)
    theirs.src_lang = languages.source
    code = load_model(out).language_codes[languages.source]
    for text in SAMPLES + TEXT:
        source = Translator.load(out).encode([text], prefix=[code])[0]
        assert [to_theirs[i] for i in source + [EOS_ID]] == theirs(text)["input_ids"], text


def assert_logits_match(imported, target, languages=NLLB):
    """Our logits are the original's over every token ours may output (1e-4), after its
    start, the target's code and random words; the others are never output."""
    _, theirs, tokenizer, out = imported
    model, ours, src = _our_source(out, SAMPLES[:4], languages.source)
    to_theirs = torch.tensor(nllb_id_of(ours, tokenizer, languages.codes))
    to_ours = {int(n): i for i, n in enumerate(to_theirs.tolist()) if n >= 0}
    tokenizer.src_lang = languages.source
    encoded = tokenizer(SAMPLES[:4], padding=True, return_tensors="pt")
    torch.manual_seed(1)
    words = torch.randint(4, 120, (4, 6))
    code = tokenizer.convert_tokens_to_ids(target)
    their_tgt = torch.cat([torch.full((4, 1), EOS_ID), torch.full((4, 1), code), words], dim=1)
    tgt = their_tgt.clone().apply_(to_ours.get)
    tgt[:, 0] = BOS_ID
    with torch.no_grad():
        expected = theirs(**encoded, decoder_input_ids=their_tgt).logits
        found = model(src, tgt)
    banned_theirs = never_output(tokenizer, languages)
    kept = [i for i, n in enumerate(to_theirs.tolist()) if n >= 0 and n not in banned_theirs]
    torch.testing.assert_close(found[..., kept], expected[..., to_theirs[kept]], rtol=1e-4,
                               atol=1e-4)
    banned = [i for i in range(len(to_theirs)) if i not in kept]
    assert torch.all(found[..., banned] <= NEVER_OUTPUT / 2)


def assert_searches_match(imported, target, languages=NLLB):
    """Greedy and beam outputs with the target's code forced are generate's (without a
    length penalty both rank finished hypotheses by log-probability)."""
    _, _, tokenizer, out = imported
    model, ours, src = _our_source(out, SAMPLES, languages.source)
    to_theirs = nllb_id_of(ours, tokenizer, languages.codes)
    forced = torch.full((len(SAMPLES), 1), model.language_codes[target])
    greedy = greedy_hypotheses(model, src, bos_id=BOS_ID, eos_id=EOS_ID, alpha=0.0,
                               max_len=12, forced=forced)
    beams = beam_search(model, src, bos_id=BOS_ID, eos_id=EOS_ID, beam=3, alpha=0.0,
                        max_len=12, forced=forced)
    for found, options in ((greedy, {"num_beams": 1}), (beams, {
            "num_beams": 3, "length_penalty": 0.0, "early_stopping": True})):
        expected = _their_outputs(imported, SAMPLES, target, languages, **options)
        assert [[to_theirs[t] for t in h[0].tokens] + [EOS_ID] * (len(e) > len(h[0].tokens))
                for h, e in zip(found, expected)] == expected


def test_the_tokenizer_gives_nllbs_ids_after_the_source_language(nllb):
    assert_ids_follow_the_source_code(nllb)


def test_logits_match_over_every_token_it_may_output(nllb):
    assert_logits_match(nllb, "fra_Latn")


@pytest.mark.parametrize("target", ["fra_Latn", "spa_Latn"])
def test_greedy_and_beam_outputs_are_transformers_with_the_target_forced(nllb, target):
    assert_searches_match(nllb, target)


def test_the_target_language_changes_the_translation(nllb):
    translator = Translator.load(nllb[3])
    french = translator.translate(SAMPLES, beam=1, source_lang="eng_Latn",
                                  target_lang="fra_Latn")
    spanish = translator.translate(SAMPLES, beam=1, target_lang="spa_Latn")
    assert french != spanish
    # Batched as one at a time, and the default pair is tokenizer_config.json's.
    assert [translator.translate([s], beam=2, target_lang="fra_Latn")[0] for s in SAMPLES] \
        == translator.translate(SAMPLES, beam=2, target_lang="fra_Latn")
    assert translator.translate(SAMPLES, beam=1) == spanish
    assert translator.decodes_continuously


@pytest.mark.parametrize("joins", [[0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5], [0, 0, 3, 3, 9, 9]])
def test_sentences_joining_a_running_search_are_searched_as_alone(nllb, joins):
    """Continuous batching (the server's): sentences into different languages, one of a
    one-pair search (no code given), joining at different steps (the last ones into an
    empty search), each get beam_search's hypotheses."""
    from transduce.decode.continuous import ContinuousBeamSearch

    translator = Translator.load(nllb[3])
    model, codes = translator.model, translator.language_codes
    ids = translator.encode(SAMPLES, prefix=[codes["eng_Latn"]])
    targets = ["fra_Latn", "spa_Latn", None, "eng_Latn", "spa_Latn", "fra_Latn"]
    expected = [beam_search(model, pad_sources([i]), bos_id=BOS_ID, eos_id=EOS_ID, beam=3,
                            max_len=10, forced=torch.tensor([[codes[t]]]) if t else None)[0]
                for i, t in zip(ids, targets)]
    search = ContinuousBeamSearch(model, bos_id=BOS_ID, eos_id=EOS_ID, beam=3, max_len=10)
    found, step = {}, 0
    while len(found) < len(SAMPLES):
        for forcing in (True, False):
            joining = [k for k, at in enumerate(joins)
                       if at == step and (targets[k] is not None) == forcing]
            if joining:
                search.add(pad_sources([ids[k] for k in joining]), joining, torch.tensor(
                    [codes[targets[k]] for k in joining]) if forcing else None)
        found.update(search.step())
        step += 1
    for k, hypotheses in found.items():
        assert [h.tokens for h in hypotheses] == [h.tokens for h in expected[k]], k
        assert hypotheses[0].score == pytest.approx(expected[k][0].score, rel=1e-5)


def test_a_decoding_process_translates_the_pair_its_stream_names(nllb):
    """The server's decoding processes (serve --decoders 2) get a stream's languages."""
    import functools

    from transduce import load
    from transduce.serve.batcher import Job
    from transduce.serve.continuous import translation_stream
    from transduce.serve.processes import DecoderProcess

    translator = Translator.load(nllb[3])
    expected = translator.translate(SAMPLES, beam=2, source_lang="eng_Latn",
                                    target_lang="fra_Latn")
    process = DecoderProcess(functools.partial(load, nllb[3]), 0)
    process.start()
    try:
        stream = translation_stream(translator, 2, 0.6, 1, None, [process],
                                    languages=("eng_Latn", "fra_Latn"))(0)
        job = Job(("translate",), lambda jobs: [], SAMPLES, 10, len(SAMPLES))
        stream.admit([job])
        answered = []
        while stream.running:
            answered += stream.step()
    finally:
        process.close()
    assert [[t.text for t in hypotheses][0] for hypotheses in answered[0][1][0]] == expected


def test_a_decoding_process_warms_up_without_a_default_pair(nllb, tmp_path):
    from transduce.serve.processes import _warm_up

    directory = tmp_path / "hf"
    shutil.copytree(nllb[0], directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "NllbTokenizer"}))
    translator = Translator.load(import_nllb(directory, tmp_path / "out"))
    assert translator.model.languages is None
    _warm_up(translator)


def test_a_forced_code_leaves_room_within_the_positions(nllb):
    """bos and the code take two of the 64 positions: outputs stop at 62 tokens."""
    model, _, src = _our_source(nllb[3], ["a"])
    forced = torch.tensor([[model.language_codes["fra_Latn"]]])
    found = greedy_hypotheses(model, src, bos_id=BOS_ID, eos_id=EOS_ID, max_len=500,
                              forced=forced)
    assert len(found[0][0].tokens) <= 63
    found = beam_search(model, src, bos_id=BOS_ID, eos_id=EOS_ID, beam=2, max_len=500,
                        forced=forced)
    assert len(found[0][0].tokens) <= 63


def test_languages_it_does_not_have_are_refused_naming_the_closest(nllb):
    translator = Translator.load(nllb[3])
    with pytest.raises(ConfigError, match="target language 'fr_Latn' is not one of this "
                                          "model's 3 language codes.*fra_Latn"):
        translator.translate(["a"], target_lang="fr_Latn")
    with pytest.raises(ConfigError, match="source language 'x'"):
        translator.translate(["a"], source_lang="x", target_lang="fra_Latn")


def test_a_model_of_one_pair_takes_its_own_pair_only():
    from transduce.decode.languages import Direction, LanguageError, direction

    with pytest.raises(LanguageError, match="source language 'fra_Latn': this model "
                                            "translates es -> en only") as error:
        direction(None, ("es", "en"), "fra_Latn", None)
    assert error.value.side == "source"
    assert direction(None, ("es", "en"), "es", "en") == Direction()
    assert direction(None, None, "anything", "else") == Direction()   # none recorded


def test_the_checkpoint_records_the_codes_and_refuses_bad_ones(nllb, tmp_path):
    out = nllb[3]
    config = json.loads((out / "config.json").read_text())
    assert config["origin"]["imported"] == "hf-nllb"
    assert config["languages"] == {"source": "eng_Latn", "target": "spa_Latn"}
    assert set(config["language_codes"]) == set(CODES)
    assert config["model"]["norm_first"] and config["model"]["positional"] == "fairseq"
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    config["language_codes"] = {"eng_Latn": "four"}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match='"language_codes" must map codes to token ids'):
        load_model(copy)


def test_the_positions_are_fairseqs_from_position_two_and_never_trained(nllb):
    theirs, ours = nllb[1], load_model(nllb[3])
    table = theirs.model.encoder.embed_positions.weights          # (row 1, pad's, is 0)
    for stack in (ours.encoder, ours.decoder):
        assert torch.equal(stack.embed.positions.table, table[2:66])
    assert torch.equal(fairseq_table(64, 32), table[2:66])
    assert not any("positions" in name for name, _ in ours.named_parameters())
    odd = fairseq_table(5, 7)                                  # transformers' zero column
    assert odd.shape == (5, 7) and torch.all(odd[:, 6] == 0)


def test_the_command_translates_between_the_languages_named(nllb, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["import", "hf-nllb", str(nllb[0]), "--out", str(out)]) == 0
    assert "encoder-decoder: 2 + 2 layers" in capsys.readouterr().out
    lines = tmp_path / "in.txt"
    lines.write_text("\n".join(SAMPLES) + "\n")
    assert main(["translate", "--model", str(out), "--input", str(lines), "--beam", "1",
                 "--target-lang", "fra_Latn", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.splitlines() == Translator.load(out).translate(
        SAMPLES, beam=1, target_lang="fra_Latn")
    assert main(["translate", "--model", str(out), "--input", str(lines),
                 "--target-lang", "french"]) == 2
    assert "target language 'french'" in capsys.readouterr().err


def test_evaluate_scores_the_translation_into_the_language_named(nllb, tmp_path, tiny_corpus,
                                                                 capsys):
    out = tmp_path / "eval"
    assert main(["evaluate", "--model", str(nllb[3]), "--data", str(tiny_corpus), "--beam", "1",
                 "--dtype", "float32",
                 "--source-lang", "spa_Latn", "--target-lang", "eng_Latn", "--out",
                 str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["languages"] == {"source": "spa_Latn", "target": "eng_Latn"}
    sources = (tiny_corpus / "test.es").read_text(encoding="utf-8").splitlines()
    assert out.with_suffix(".hyp").read_text(encoding="utf-8").splitlines() == \
        Translator.load(nllb[3]).translate(sources, beam=1, source_lang="spa_Latn",
                                           target_lang="eng_Latn")
    assert main(["evaluate", "--model", str(nllb[3]), "--data", str(tiny_corpus),
                 "--target-lang", "xx", "--out", str(tmp_path / "bad")]) == 2
    assert "target language 'xx'" in capsys.readouterr().err


def test_a_model_without_a_default_pair_asks_for_one(nllb, tmp_path):
    directory = tmp_path / "hf"
    shutil.copytree(nllb[0], directory)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["tgt_lang"] = None
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    translator = Translator.load(import_nllb(directory, tmp_path / "out"))
    with pytest.raises(ConfigError, match="between 3 languages: name the source and the "
                                          "target"):
        translator.translate(["a"])


def test_the_server_translates_between_the_languages_each_request_names(nllb):
    from transduce.serve import create_app

    translator = Translator.load(nllb[3])
    expected = translator.translate(SAMPLES[:2], beam=4, target_lang="fra_Latn")
    with TestClient(create_app(translator, name="nllb")) as client:
        answer = client.post("/v1/translate", json={"texts": SAMPLES[:2],
                                                    "target_lang": "fra_Latn"})
        assert answer.status_code == 200
        assert [t["text"] for t in answer.json()["translations"]] == expected
        libre = client.post("/translate", json={"q": SAMPLES[:2], "source": "eng_Latn",
                                                "target": "fra_Latn"})
        assert libre.status_code == 200 and libre.json()["translatedText"] == expected
        bad = client.post("/v1/translate", json={"texts": ["a"], "target_lang": "xx"})
        assert bad.status_code == 422 and "target_lang" in bad.text
        bad = client.post("/translate", json={"q": "a", "source": "xx", "target": "fra_Latn"})
        assert bad.status_code == 400 and "source" in bad.text
        languages = client.get("/languages").json()
        assert [entry["code"] for entry in languages] == sorted(CODES)
        assert all(entry["targets"] == sorted(CODES) for entry in languages)
        info = client.get("/v1/models").json()["data"][0]
        assert info["language_codes"] == sorted(CODES)
        assert info["languages"] == {"source": "eng_Latn", "target": "spa_Latn"}
        maps = client.post("/v1/attention", json={"text": SAMPLES[0], "target_lang": "fra_Latn",
                                                   "kinds": ["cross"], "layers": [1]})
        assert maps.status_code == 200 and maps.json()["translation"] == expected[0]
        bad = client.post("/v1/attention", json={"text": "a", "source_lang": "xx"})
        assert bad.status_code == 422 and "source_lang" in bad.text


def test_the_servers_languages_are_a_multilingual_models_default_pair(nllb):
    from transduce.serve import create_app

    translator = Translator.load(nllb[3])
    expected = translator.translate(SAMPLES[:2], source_lang="spa_Latn", target_lang="fra_Latn")
    with TestClient(create_app(translator, languages=("spa_Latn", "fra_Latn"))) as client:
        answer = client.post("/v1/translate", json={"texts": SAMPLES[:2]})
        assert [t["text"] for t in answer.json()["translations"]] == expected
        libre = client.post("/translate", json={"q": SAMPLES[:2], "source": "auto",
                                                "target": "fra_Latn"}).json()
        assert libre["translatedText"] == expected
        assert libre["detectedLanguage"][0]["language"] == "spa_Latn"
        info = client.get("/v1/models").json()["data"][0]
        assert info["languages"] == {"source": "spa_Latn", "target": "fra_Latn"}
    with pytest.raises(ConfigError, match="target language 'en' is not one of"):
        create_app(translator, languages=("eng_Latn", "en"))


def test_attention_maps_are_those_of_the_translation_into_the_language_named(nllb, tmp_path):
    from transduce.attention_maps import attention_maps

    translator = Translator.load(nllb[3])
    maps = attention_maps(translator, SAMPLES[0], beam=2, source_lang="eng_Latn",
                          target_lang="fra_Latn")
    assert maps.translation == translator.translate([SAMPLES[0]], beam=2,
                                                    target_lang="fra_Latn")[0]
    assert maps.source_tokens[0] == "\u2581eng_Latn"
    assert maps.target_inputs[:2] == ["<bos>", "\u2581fra_Latn"]
    assert maps.target_outputs[0] == "\u2581fra_Latn"      # given after bos
    assert len(maps.target_outputs) == len(maps.target_inputs) == maps.cross[0].shape[1]
    assert main(["attention", SAMPLES[0], "--model", str(nllb[3]), "--out",
                 str(tmp_path / "maps.png"), "--layer", "1", "--target-lang", "fra_Latn"]) == 0
    assert (tmp_path / "maps.png").stat().st_size > 0


def test_the_onnx_export_translates_between_the_languages_named(nllb, tmp_path):
    pytest.importorskip("onnxruntime")
    from transduce.export.onnx import export_onnx

    exported = export_onnx(nllb[3], tmp_path / "onnx")
    ours = Translator.load(nllb[3]).translate(SAMPLES, beam=2, target_lang="fra_Latn")
    assert Translator.load(exported).translate(SAMPLES, beam=2, target_lang="fra_Latn") == ours


def test_the_ctranslate2_export_translates_with_the_code_as_target_prefix(nllb, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transduce.export import export_ctranslate2

    out = nllb[3]
    exported = export_ctranslate2(out, tmp_path / "ct2")
    pieces = json.loads((exported / "transduce-export.json").read_text())[
        "language_code_pieces"]
    ours = Tokenizer(out / checkpoint.TOKENIZER)
    translator = ctranslate2.Translator(str(exported), device="cpu", intra_threads=1)
    sources = [[pieces["eng_Latn"]] + [ours.piece(i) for i in ids]
               for ids in ours.encode(SAMPLES)]
    found = translator.translate_batch(sources, target_prefix=[[pieces["fra_Latn"]]] *
                                       len(SAMPLES), beam_size=1, max_decoding_length=13,
                                       min_decoding_length=0)
    texts = [ours.decode([ours.processor.piece_to_id(p) for p in r.hypotheses[0][1:]])
             for r in found]
    assert texts == Translator.load(out).translate(SAMPLES, beam=1, max_length=12,
                                                   target_lang="fra_Latn")


def test_training_batches_score_what_transformers_scores_after_the_forced_code(nllb):
    """A pair as fine-tuning batches it (source code first, the target's code given
    after bos and not scored) has the NLL transformers gives NllbTokenizer's labels,
    less the code's own (the first label), over the tokens ours may output."""
    from transduce.data.batching import TokenBatcher
    from transduce.train.loss import projected_label_smoothed_nll

    _, theirs, tokenizer, out = nllb
    model, ours = load_model(out), Tokenizer(out / checkpoint.TOKENIZER)
    sources, targets = TEXT[:4], TEXT[3:7]
    codes = model.language_codes
    batcher = TokenBatcher([torch.tensor(ids).numpy() for ids in ours.encode(sources)],
                           [torch.tensor(ids).numpy() for ids in ours.encode(targets)], 4096,
                           shuffle=False, source_prefix=[codes["eng_Latn"]],
                           forced=[codes["spa_Latn"]])
    batch = batcher.collate(torch.arange(4).numpy())
    with torch.no_grad():
        _, found = projected_label_smoothed_nll(model(batch.src, batch.tgt_in, project=False),
                                                model.output_proj.weight, batch.tgt_out, 0.0,
                                                PAD_ID, bias=model.output_proj.bias)
        tokenizer.src_lang, tokenizer.tgt_lang = "eng_Latn", "spa_Latn"
        encoded = tokenizer(sources, text_target=targets, padding=True, return_tensors="pt")
        labels = encoded.pop("labels")
        logits = theirs(**encoded, labels=labels).logits
        logits[..., never_output(tokenizer)] = float("-inf")
        nll = torch.nn.functional.cross_entropy(logits[:, 1:].transpose(1, 2), labels[:, 1:],
                                                ignore_index=tokenizer.pad_token_id,
                                                reduction="sum")
    assert int(batch.tgt_lengths.sum()) == int((labels[:, 1:] != tokenizer.pad_token_id).sum())
    torch.testing.assert_close(found, nll, rtol=1e-5, atol=1e-4)


def test_fine_tuning_on_a_pair_keeps_the_codes_and_makes_it_the_default(nllb, tmp_path,
                                                                        tiny_corpus, capsys):
    out = nllb[3]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for file in tiny_corpus.iterdir():
        if file.is_file() and not file.name.startswith("spm."):
            (corpus / file.name).write_bytes(file.read_bytes())
    args = ["train", "--data", str(corpus), "--init", str(out), "--max-steps", "4",
            "--eval-every", "4", "--save-every", "2", "--max-tokens", "512",
            "--dev-bleu-sentences", "4"]
    assert main(args + ["--out", str(tmp_path / "none")]) == 2
    assert "the model is multilingual (3 language codes): name the corpus's languages" in \
        capsys.readouterr().err
    assert main(args + ["--out", str(tmp_path / "unknown"), "--source-lang", "spa",
                        "--target-lang", "eng_Latn"]) == 2
    assert "source language 'spa'" in capsys.readouterr().err
    assert main(args + ["--out", str(tmp_path / "run"), "--source-lang", "spa_Latn",
                        "--target-lang", "eng_Latn"]) == 0
    tuned = checkpoint.resolve(tmp_path / "run")
    assert checkpoint.read_language_codes(tuned) == load_model(out).language_codes
    assert checkpoint.read_languages(tuned) == ("spa_Latn", "eng_Latn")
    translator = Translator.load(tuned)
    assert translator.translate(["uno dos"], beam=1) == translator.translate(
        ["uno dos"], beam=1, source_lang="spa_Latn", target_lang="eng_Latn")
    # A resumed run gives its pairs the same codes (from its own checkpoints).
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--resume",
                 "--max-steps", "6"]) == 0
    assert checkpoint.read_languages(checkpoint.resolve(tmp_path / "run")) == \
        ("spa_Latn", "eng_Latn")
    assert main(["average", str(tmp_path / "run"), "--out", str(tmp_path / "average")]) == 0
    assert checkpoint.read_language_codes(tmp_path / "average") == load_model(out).language_codes


def test_a_model_of_one_pair_refuses_language_codes_to_train_on(tiny_corpus, tmp_path,
                                                                 capsys):
    assert main(["train", "--data", str(tiny_corpus), "--out", str(tmp_path / "run"),
                 "--preset", "tiny", "--max-steps", "1", "--source-lang", "spa_Latn",
                 "--target-lang", "eng_Latn"]) == 2
    assert "this model has none" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


WMT21 = ["en", "ha", "is", "ja", "cs", "ru", "zh", "de"]     # M2M-100's "wmt21" codes


def write_m2m100(directory):
    """A small random M2M-100 directory (M2M100Tokenizer's files: vocab.json over the
    SentencePiece pieces, language_codes "wmt21") -> (directory, its tokenizer)."""
    directory.mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT * 20), minloglevel=2,
                                   model_prefix=str(directory / "sentencepiece.bpe"),
                                   vocab_size=120, model_type="bpe", hard_vocab_limit=False)
    processor = spm.SentencePieceProcessor(model_file=str(directory / "sentencepiece.bpe.model"))
    pieces = ["<s>", "<pad>", "</s>", "<unk>"] + [
        processor.id_to_piece(i) for i in range(processor.get_piece_size())
        if not (processor.is_control(i) or processor.is_unknown(i))]
    (directory / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "M2M100Tokenizer", "language_codes": "wmt21", "src_lang": "en",
         "tgt_lang": "de"}))
    tokenizer = transformers.M2M100Tokenizer.from_pretrained(directory)
    torch.manual_seed(8)
    config = transformers.M2M100Config(
        vocab_size=len(pieces) + len(WMT21), d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, dropout=0.0)
    model = transformers.M2M100ForConditionalGeneration(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("proj.weight") or ".fc" in name:
                parameter.normal_(0.0, 1.0)
        model.model.shared.weight.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return directory, tokenizer


def test_m2m100_imports_with_its_codes_after_its_vocabulary(tmp_path):
    directory, tokenizer = write_m2m100(tmp_path / "hf")
    out = import_nllb(directory, tmp_path / "ours")
    translator = Translator.load(out)
    codes = translator.language_codes
    assert sorted(codes) == sorted(WMT21) and translator.model.languages == ("en", "de")
    ours = translator.tokenizer
    to_theirs = [-1 if i in (PAD_ID, BOS_ID) else tokenizer.convert_tokens_to_ids(
        ours.piece(i).removeprefix("\u2581") if ours.piece(i).startswith("\u2581__")
        else ours.piece(i)) for i in range(ours.vocab_size)]
    for code in WMT21:
        assert to_theirs[codes[code]] == tokenizer.get_lang_id(code)
    tokenizer.src_lang = "en"
    for text in SAMPLES + TEXT:
        source = translator.encode([text], prefix=[codes["en"]])[0]
        assert [to_theirs[i] for i in source + [EOS_ID]] == tokenizer(text)["input_ids"], text
    theirs = transformers.M2M100ForConditionalGeneration.from_pretrained(directory).eval()
    encoded = tokenizer(SAMPLES, padding=True, return_tensors="pt")
    # What ours never outputs: pad, bos, the codes, and the rows no token of its uses.
    banned = [tokenizer.pad_token_id, tokenizer.bos_token_id] + [
        tokenizer.get_lang_id(code) for code in WMT21] + sorted(
        set(range(theirs.config.vocab_size)) - set(to_theirs))
    processors = transformers.LogitsProcessorList([_AfterTheForcedCode(banned)])
    model, src = translator.model, pad_sources(translator.encode(SAMPLES, prefix=[codes["en"]]))
    forced = torch.full((len(SAMPLES), 1), codes["ru"])
    # Greedy, then beams without a length penalty (both rank by log-probability, with
    # the banned tokens' share taken out as ours does).
    for beam, search in ((1, greedy_hypotheses), (3, functools.partial(beam_search, beam=3))):
        with torch.no_grad():
            out_ids = theirs.generate(
                **encoded, forced_bos_token_id=tokenizer.get_lang_id("ru"), num_beams=beam,
                do_sample=False, max_new_tokens=13, logits_processor=processors,
                renormalize_logits=True, length_penalty=0.0, early_stopping=True)
        expected = [[t for t in row[2:] if t != tokenizer.pad_token_id]
                    for row in out_ids.tolist()]
        found = search(model, src, bos_id=BOS_ID, eos_id=EOS_ID, alpha=0.0, max_len=12,
                       forced=forced)
        assert [[to_theirs[t] for t in h[0].tokens] + [EOS_ID] * (len(e) > len(h[0].tokens))
                for h, e in zip(found, expected)] == expected
        assert len({tuple(e) for e in expected}) > 1


def test_m2m100_language_lists_it_does_not_know_are_refused(tmp_path):
    directory, _ = write_m2m100(tmp_path / "base")
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {**settings, "language_codes": "m2m200"}))
    assert_refused(import_nllb, directory, tmp_path, "language_codes='m2m200'")


REFUSED_CONFIGS = [
    (lambda c: {**c, "model_type": "nllb-moe"}, "model_type='nllb-moe'"),
    (lambda c: {**c, "activation_function": "tanh"}, "activation_function='tanh'"),
    (lambda c: {**c, "tie_word_embeddings": False}, "tie_word_embeddings=false"),
    (lambda c: {**c, "decoder_ffn_dim": 32}, "our stacks share d_ff"),
    (lambda c: {**c, "pad_token_id": 5}, "pad_token_id=5"),
    (lambda c: {**c, "decoder_start_token_id": 10 ** 6}, "decoder_start_token_id=1000000"),
]
REFUSED_WEIGHTS = [
    (lambda t: {k: v for k, v in t.items() if k != "model.decoder.layer_norm.bias"},
     "missing weight 'decoder.layer_norm.bias'"),
    (lambda t: {**t, "model.extra.weight": torch.zeros(2)}, "unknown weight 'model.extra.weight'"),
    (lambda t: {**t, "model.encoder.embed_positions.weights": torch.zeros(66, 32)},
     "'encoder.embed_positions.weights' is not the sinusoidal table NLLB computes"),
]


@pytest.mark.parametrize("part, change, message",
                         [("config", *case) for case in REFUSED_CONFIGS]
                         + [("weights", *case) for case in REFUSED_WEIGHTS])
def test_configurations_and_weights_we_cannot_reproduce_are_refused_by_name(nllb, tmp_path,
                                                                            part, change,
                                                                            message):
    bad = damaged(nllb[0], tmp_path, **{part: change})
    assert_refused(import_nllb, bad, tmp_path, message)


def test_a_stored_position_table_imports(nllb, tmp_path):
    """Older transformers saved the tables (all 66 rows; rows 0 and 1 are never read)."""
    table = nllb[1].model.encoder.embed_positions.weights.clone()

    def with_tables(tensors):
        for stack in ("encoder", "decoder"):
            tensors[f"model.{stack}.embed_positions.weights"] = table.clone()

    imported = load_model(import_nllb(damaged(nllb[0], tmp_path, weights=with_tables),
                                      tmp_path / "out")).state_dict()
    assert all(torch.equal(imported[name], weight)
               for name, weight in load_model(nllb[3]).state_dict().items())


def test_sharded_pytorch_model_bin_files_import_as_one(nllb, tmp_path):
    """NLLB-3.3B comes as pytorch_model-0000N-of-0000M.bin with an index."""
    from safetensors.torch import load_file

    directory = tmp_path / "hf"
    shutil.copytree(nllb[0], directory)
    tensors = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"pytorch_model-00001-of-00002.bin": names[:len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for file, part in halves.items():
        torch.save({name: tensors[name] for name in part}, directory / file)
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {name: file for file, part in halves.items() for name in part}}))
    imported = load_model(import_nllb(directory, tmp_path / "out")).state_dict()
    assert all(torch.equal(imported[name], weight)
               for name, weight in load_model(nllb[3]).state_dict().items())
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}}))
    assert_refused(import_nllb, directory, tmp_path / "again",
                   'pytorch_model.bin.index.json: no "weight_map"')


def test_float16_weights_import_rounded(nllb, tmp_path):
    half = damaged(nllb[0], tmp_path, weights=lambda tensors: {
        name: tensor.half() for name, tensor in tensors.items()})
    imported = load_model(import_nllb(half, tmp_path / "out")).state_dict()
    for name, weight in load_model(nllb[3]).state_dict().items():
        if "positions" in name:                  # computed, not read
            assert torch.equal(imported[name], weight), name
        elif name != "output_proj.bias":         # (zeros and never-output tokens)
            assert torch.equal(imported[name], weight.half().float()), name


@pytest.mark.parametrize("missing, message", [
    (["tokenizer.json"], "no tokenizer.json (NLLB's) or vocab.json (M2M-100's)"),
    (["sentencepiece.bpe.model"], "no sentencepiece.bpe.model")])
def test_tokenizer_files_it_needs_are_named(nllb, tmp_path, missing, message):
    directory = tmp_path / "hf"
    shutil.copytree(nllb[0], directory)
    for name in missing:
        (directory / name).unlink()
    assert_refused(import_nllb, directory, tmp_path, message)


def test_a_tokenizer_without_language_codes_is_refused(nllb, tmp_path):
    directory = tmp_path / "hf"
    shutil.copytree(nllb[0], directory)
    values = json.loads((directory / "tokenizer.json").read_text())
    values["added_tokens"] = [t for t in values["added_tokens"] if t["content"] not in CODES]
    (directory / "tokenizer.json").write_text(json.dumps(values))
    assert_refused(import_nllb, directory, tmp_path, "no language codes")
