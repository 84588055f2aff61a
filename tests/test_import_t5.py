"""Hugging Face T5 -> our checkpoint: the imported model computes what
transformers.T5ForConditionalGeneration computes (logits over every token it may output,
greedy and beam outputs as text), in both of T5's layouts (the original's ReLU and
scaled, tied output; v1.1's gated GELU, lm_head of its own and heads narrower than
d_model / heads), its tokenizer gives T5Tokenizer's ids, sentinels included, and a
checkpoint we cannot reproduce is refused by name with nothing written."""

import json
import warnings

import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file, save_file

from transduce import checkpoint
from transduce.cli import main
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transduce.decode.translate import Translator
from transduce.importers import import_t5
from transduce.model import load_model
from transduce.model.transformer import NEVER_OUTPUT
from tests.foreign_checkpoints import assert_refused, damaged

transformers = pytest.importorskip("transformers")

TEXTS = ["translate English to German: The house is wonderful.",
         "translate English to German: How old are you?",
         "summarize: The quick brown fox jumps over the lazy dog again and again.",
         "Das Haus ist wunderbar. Wie alt bist du?", "Numbers 12, 345 and 6789; café naïve",
         "The <extra_id_0> walks in <extra_id_1> park"]
SAMPLES = ["translate English to German: The house.", "summarize: the lazy dog",
           "The <extra_id_0> walks in <extra_id_1> park", "café  naïve ＡＢＣ", "zzzz qqqq",
           "a"]
EXTRA_IDS, PADDING_ROWS = 5, 3       # the sentinels, and rows past the tokenizer's ids
# The two layouts: the original T5 (ReLU, output tied to the embedding and scaled by
# d_model^-0.5) and v1.1 / Flan-T5 (gated GELU, an lm_head of its own, no scaling),
# here with 3 heads of 8 in a model of 32.
LAYOUTS = {"t5": dict(feed_forward_proj="relu", num_heads=4, d_kv=8),
           "v1.1": dict(feed_forward_proj="gated-gelu", num_heads=3, d_kv=8)}


def write_t5(directory, layout="v1.1", **config_changes):
    """A small random T5ForConditionalGeneration with spiece.model -> its directory."""
    directory.mkdir()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 20), model_prefix=str(directory / "spiece"),
        vocab_size=80, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        normalization_rule_name="nmt_nfkc", minloglevel=2, hard_vocab_limit=False)
    pieces = spm.SentencePieceProcessor(model_file=str(directory / "spiece.model"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "T5Tokenizer", "extra_ids": EXTRA_IDS, "eos_token": "</s>",
         "unk_token": "<unk>", "pad_token": "<pad>"}))
    untied = layout == "v1.1"
    values = dict(vocab_size=pieces.get_piece_size() + EXTRA_IDS + PADDING_ROWS, d_model=32,
                  d_ff=48, num_layers=2, num_decoder_layers=3, dropout_rate=0.0,
                  decoder_start_token_id=0, **LAYOUTS[layout])
    values.update(config_changes)
    torch.manual_seed(7)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**values)).eval()
    with torch.no_grad():     # norms and position biases away from their init
        for name, parameter in model.named_parameters():
            if "layer_norm" in name or "relative_attention_bias" in name:
                parameter.add_(0.5 * torch.randn_like(parameter))
        model.shared.weight.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    if untied:     # v1.1's lm_head, as its checkpoints store it (transformers 5 ties T5's
        # output unless the file holds another matrix; older configs say so instead)
        tensors = load_file(str(directory / "model.safetensors"))
        tensors["lm_head.weight"] = torch.randn(values["vocab_size"], values["d_model"]) * 0.5
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        config.pop("scale_decoder_outputs", None)
        config["tie_word_embeddings"] = False
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _load_theirs(directory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.T5ForConditionalGeneration.from_pretrained(directory).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return model, tokenizer


@pytest.fixture(scope="module", params=list(LAYOUTS))
def t5(request, tmp_path_factory):
    """(the layout, the T5 directory, its model, its tokenizer, our import)."""
    root = tmp_path_factory.mktemp(f"t5-{request.param}")
    directory = write_t5(root / "hf", request.param)
    theirs, tokenizer = _load_theirs(directory)
    return request.param, directory, theirs, tokenizer, import_t5(directory, root / "ours")


def t5_id_of(ours: Tokenizer, tokenizer) -> list[int]:
    """Per id of ours, T5's id of the same piece (a sentinel of ours starts with the word
    boundary), -1 for bos (T5 has none: it takes pad's row)."""
    ids = []
    for i in range(ours.vocab_size):
        piece = ours.piece(i)
        piece = piece[1:] if piece.startswith("\u2581<extra_id_") else piece
        ids.append(-1 if i == BOS_ID else tokenizer.convert_tokens_to_ids(piece))
    return ids


def test_the_tokenizer_gives_t5s_ids_with_its_sentinels(t5):
    _, _, _, tokenizer, out = t5
    ours = Tokenizer(out / checkpoint.TOKENIZER)
    to_t5 = t5_id_of(ours, tokenizer)
    assert len(set(to_t5)) == len(to_t5) and ours.vocab_size == len(tokenizer) + 1
    for text in SAMPLES:
        assert [to_t5[i] for i in ours.encode([text])[0] + [EOS_ID]] == \
            tokenizer(text)["input_ids"], text


def test_logits_match_over_every_token_it_may_output(t5):
    """A right-padded batch of sources and random targets: T5's logits, in our ids'
    order, past pad and bos; pad and bos are never output."""
    _, _, theirs, tokenizer, out = t5
    to_t5 = torch.tensor(t5_id_of(Tokenizer(out / checkpoint.TOKENIZER), tokenizer))
    to_ours = {int(t): i for i, t in enumerate(to_t5.tolist()) if t >= 0}
    encoded = tokenizer(SAMPLES, padding=True, return_tensors="pt")
    their_src, mask = encoded["input_ids"], encoded["attention_mask"]
    src = their_src.clone().apply_(lambda t: to_ours[t]).masked_fill(mask == 0, PAD_ID)
    torch.manual_seed(1)
    outputs = torch.randint(1, len(tokenizer), (len(SAMPLES), 7))
    their_tgt = torch.cat([torch.zeros(len(SAMPLES), 1, dtype=torch.long), outputs], dim=1)
    tgt = torch.cat([torch.full((len(SAMPLES), 1), BOS_ID), outputs.clone().apply_(
        lambda t: to_ours[t])], dim=1)
    with torch.no_grad():
        expected = theirs(input_ids=their_src, attention_mask=mask,
                          decoder_input_ids=their_tgt).logits
        found = load_model(out)(src, tgt)
    torch.testing.assert_close(found[..., 2:], expected[..., to_t5[2:]], rtol=1e-4, atol=1e-4)
    assert torch.all(found[..., [PAD_ID, BOS_ID]] <= NEVER_OUTPUT / 2)


def _generate(theirs, tokenizer, texts, **options):
    """transformers' outputs, never pad, the rows past the tokenizer's (as ours) nor the
    sentinels (which its decoding drops: _translator bans them); without its cache,
    which it sizes by the encoder's layers (3 decoder layers here)."""
    never = [[0]] + [[i] for i in range(len(tokenizer) - EXTRA_IDS, theirs.config.vocab_size)]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = theirs.generate(**encoded, max_new_tokens=10, do_sample=False,
                              bad_words_ids=never, use_cache=False, **options)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def _translator(out):
    """Our translator with the sentinels never output (as _generate asks of T5's)."""
    translator = Translator.load(out, dtype="float32")
    ours = Tokenizer(out / checkpoint.TOKENIZER)
    sentinels = [i for i in range(ours.vocab_size) if "<extra_id_" in ours.piece(i)]
    assert len(sentinels) == EXTRA_IDS
    with torch.no_grad():
        translator.model.output_proj.bias[sentinels] = NEVER_OUTPUT
    return translator


def test_greedy_and_beam_outputs_are_transformers(t5):
    _, _, theirs, tokenizer, out = t5
    translator = _translator(out)
    assert translator.translate(SAMPLES, beam=1, max_length=10) == \
        _generate(theirs, tokenizer, SAMPLES, num_beams=1)
    assert translator.translate(SAMPLES, beam=3, alpha=0.0, max_length=10) == \
        _generate(theirs, tokenizer, SAMPLES, num_beams=3, length_penalty=0.0,
                  early_stopping=True, renormalize_logits=True)


def test_a_batch_translates_as_each_sentence_alone(t5):
    translator = Translator.load(t5[4], dtype="float32")
    together = translator.translate(SAMPLES, beam=2, max_length=8)
    assert together == [translator.translate([text], beam=2, max_length=8)[0]
                        for text in SAMPLES]


def test_the_layouts_are_folded_into_our_configuration(t5):
    layout, _, theirs, _, out = t5
    config = load_model(out).config
    assert (config.positional, config.norm, config.norm_first, config.bias) == \
        ("t5", "rms", True, False)
    assert config.attention_scale and not config.scale_embeddings      # folded in weights
    if layout == "t5":
        assert (config.tie_embeddings, config.gated_ffn, config.activation, config.head_size) \
            == ("all", False, "relu", None)
    else:
        assert (config.tie_embeddings, config.gated_ffn, config.activation, config.head_size) \
            == ("embeddings", True, "gelu-tanh", 8)
        assert config.head_dim * config.num_heads == 24 != config.d_model
    assert json.loads((out / "config.json").read_text())["origin"]["imported"] == "hf-t5"


def test_the_command_imports_and_translates(t5, tmp_path, capsys):
    layout, directory, theirs, tokenizer, _ = t5
    assert main(["import", "hf-t5", str(directory), "--out", str(tmp_path / "m")]) == 0
    heads = "3 heads" if layout == "v1.1" else "4 heads"
    assert f"encoder-decoder: 2 + 3 layers, d_model 32, {heads}" in capsys.readouterr().out
    (tmp_path / "in.txt").write_text(SAMPLES[0] + "\n")
    assert main(["translate", "--model", str(tmp_path / "m"), "--input",
                 str(tmp_path / "in.txt"), "--beam", "1", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip() == \
        Translator.load(tmp_path / "m", dtype="float32").translate(SAMPLES[:1], beam=1)[0]


def test_stored_copies_and_an_unread_cross_attention_table_import(tmp_path):
    """Older checkpoints store the stacks' embeddings and a relative-position table for
    cross-attention, which T5 never reads."""
    directory = write_t5(tmp_path / "base", "t5")

    def with_copies(tensors):
        tensors["encoder.embed_tokens.weight"] = tensors["shared.weight"].clone()
        tensors["lm_head.weight"] = tensors["shared.weight"].clone()       # tied
        tensors["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = \
            torch.zeros(32, 4)

    out = import_t5(damaged(directory, tmp_path, weights=with_copies), tmp_path / "ours")
    assert load_model(out).config.tie_embeddings == "all"


def _without(name):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


REFUSED_CONFIGS = [
    (lambda c: {**c, "model_type": "umt5"}, "model_type='umt5'"),
    (lambda c: {**c, "relative_attention_num_buckets": 64},
     "relative_attention_num_buckets=64 is not supported"),
    (lambda c: {**c, "relative_attention_max_distance": 256},
     "relative_attention_max_distance=256"),
    (lambda c: {**c, "feed_forward_proj": "gated-tanh"}, "feed_forward_proj='gated-tanh'"),
    (lambda c: {**c, "feed_forward_proj": "fancy-gelu"}, "feed_forward_proj='fancy-gelu'"),
    (lambda c: {**c, "eos_token_id": 5}, "eos_token_id=5"),
    (lambda c: {**c, "vocab_size": 20}, "vocab_size - 1 = 19"),
    (lambda c: {**c, "decoder_start_token_id": 10 ** 6}, "decoder_start_token_id=1000000"),
    (lambda c: {k: v for k, v in c.items() if k != "d_kv"}, "no 'd_kv'"),
]
REFUSED_WEIGHTS = [
    (_without("decoder.block.2.layer.1.EncDecAttention.k.weight"),
     "missing weight 'decoder.block.2.layer.1.EncDecAttention.k.weight'"),
    (_without("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
     "missing weight 'encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight'"),
    (lambda t: {**t, "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight":
                torch.zeros(32, 3)}, "unknown weight"),
    (lambda t: {**t, "decoder.embed_tokens.weight": t["shared.weight"] + 1.0},
     "'decoder.embed_tokens.weight' differs from 'shared.weight'"),
    (lambda t: {**t, "encoder.final_layer_norm.weight": torch.ones(31)},
     "'encoder.final_layer_norm.weight' has shape (31,)"),
]


@pytest.mark.parametrize("part, change, message",
                         [("config", *case) for case in REFUSED_CONFIGS]
                         + [("weights", *case) for case in REFUSED_WEIGHTS])
def test_configurations_and_weights_we_cannot_reproduce_are_refused_by_name(tmp_path, part,
                                                                            change, message):
    directory = write_t5(tmp_path / "base")
    assert_refused(import_t5, damaged(directory, tmp_path, **{part: change}), tmp_path, message)


def test_tokenizer_files_we_cannot_read_are_refused(tmp_path):
    directory = write_t5(tmp_path / "base")
    missing = damaged(directory, tmp_path / "a")
    (missing / "spiece.model").unlink()
    assert_refused(import_t5, missing, tmp_path / "a", "no spiece.model")
    other = damaged(directory, tmp_path / "b")
    (other / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"id": 3, "content": "<extra_id_0>", "special": True}]}))
    assert_refused(import_t5, other, tmp_path / "b", "tokenizer.json: <extra_id_0> is id 3")
    counted = damaged(directory, tmp_path / "c")
    (counted / "tokenizer_config.json").write_text(json.dumps({"extra_ids": "many"}))
    assert_refused(import_t5, counted, tmp_path / "c", "extra_ids='many'")


def test_an_imported_model_fine_tunes_with_its_embeddings_shared(t5, tmp_path, tiny_corpus):
    """Training reads the checkpoint's vocabulary, and keeps one matrix for both sides'
    embeddings (v1.1's lm_head its own); the relative-position tables train too."""
    layout, _, _, _, out = t5
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for file in tiny_corpus.iterdir():
        if file.is_file() and not file.name.startswith("spm."):
            (corpus / file.name).write_bytes(file.read_bytes())
    assert main(["train", "--data", str(corpus), "--init", str(out), "--out",
                 str(tmp_path / "run"), "--max-steps", "4", "--eval-every", "4",
                 "--save-every", "4", "--log-every", "2"]) == 0
    tuned, before = load_model(tmp_path / "run"), load_model(out)
    assert tuned.config == before.config
    assert tuned.encoder.embed.embedding is tuned.decoder.embed.embedding
    assert (tuned.output_proj.weight is tuned.decoder.embed.embedding.weight) == (layout == "t5")
    for name in ("encoder.score_bias.table.weight", "output_proj.weight"):
        assert not torch.equal(tuned.state_dict()[name], before.state_dict()[name]), name
    assert torch.equal(tuned.output_proj.bias, before.output_proj.bias)


def test_the_ctranslate2_export_translates_as_we_do(t5, tmp_path):
    """CTranslate2's T5 layout: RMSNorm, gated or plain FFN, the relative-position table
    shared by a stack's layers, heads of any size; greedy and beam outputs are ours."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transduce.export import export_ctranslate2

    out = t5[4]
    exported = export_ctranslate2(out, tmp_path / "ct2")
    ours = Tokenizer(out / checkpoint.TOKENIZER)
    translator = ctranslate2.Translator(str(exported), device="cpu", intra_threads=1)
    pieces = [[ours.piece(i) for i in ids] for ids in ours.encode(SAMPLES)]
    for beam in (1, 3):
        found = translator.translate_batch(pieces, beam_size=beam, max_decoding_length=10,
                                           min_decoding_length=0, length_penalty=0.0)
        texts = [ours.decode([ours.processor.piece_to_id(p) for p in r.hypotheses[0]])
                 for r in found]
        assert texts == Translator.load(out, dtype="float32").translate(
            SAMPLES, beam=beam, alpha=0.0, max_length=10), beam


def test_the_server_translates_as_the_translator_does(t5):
    """The server's continuous search (sentences joining a running batch: T5's bias over
    each sentence's own slots) answers what offline translation gives."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from transduce.serve import create_app

    from concurrent.futures import ThreadPoolExecutor

    translator = Translator.load(t5[4], dtype="float32")
    requests = [{"texts": [text], "beam": beam, "max_length": 10}
                for beam in (1, 3) for text in SAMPLES]
    with TestClient(create_app(translator, name="t5")) as client, \
            ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda body: client.post("/v1/translate", json=body),
                                requests))
    assert all(answer.status_code == 200 for answer in answers)
    assert [answer.json()["translations"][0]["text"] for answer in answers] == \
        [translator.translate([text], beam=beam, max_length=10)[0]
         for beam in (1, 3) for text in SAMPLES]


def test_the_hugging_face_export_computes_the_same_and_imports_back(t5, tmp_path):
    """export hf writes T5ForConditionalGeneration again (queries unscaled, a tied
    output's scale undone, our ids with MarianTokenizer's files): the same logits and
    translations in transformers, and the same weights imported back."""
    from transduce.export import export_hf

    layout, _, _, _, out = t5
    exported = export_hf(out, tmp_path / "hf")
    theirs, tokenizer = _load_theirs(exported)
    assert type(theirs).__name__ == "T5ForConditionalGeneration"
    assert (theirs.lm_head.weight is theirs.shared.weight) == (layout == "t5")
    ours = load_model(out)
    encoded = tokenizer(SAMPLES, padding=True, return_tensors="pt")
    ids = Tokenizer(out / checkpoint.TOKENIZER).encode(SAMPLES)
    assert [row[:len(mine) + 1] for row, mine in zip(encoded["input_ids"].tolist(), ids)] == \
        [mine + [EOS_ID] for mine in ids]
    tgt = torch.cat([torch.full((len(SAMPLES), 1), BOS_ID),
                     torch.randint(2, ours.config.tgt_vocab_size, (len(SAMPLES), 6))], dim=1)
    with torch.no_grad():
        expected = ours(encoded["input_ids"], tgt)
        found = theirs(**encoded, decoder_input_ids=tgt).logits
    torch.testing.assert_close(found[..., 2:], expected[..., 2:], rtol=1e-4, atol=1e-4)
    with torch.no_grad():     # generation_config: our search's defaults, pad and bos never
        generated = theirs.generate(**encoded, num_beams=1, max_new_tokens=10,
                                    use_cache=False)      # (see _generate)
    assert tokenizer.batch_decode(generated, skip_special_tokens=True) == \
        Translator.load(out, dtype="float32").translate(SAMPLES, beam=1, max_length=10)
    back = load_model(import_t5(exported, tmp_path / "back"))
    assert back.config == ours.config
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], tensor, rtol=1e-6, atol=1e-6,
                                   msg=name)


def test_the_hugging_face_export_refuses_what_t5_cannot_hold(tmp_path, tiny_corpus):
    from transduce.config import preset
    from transduce.export import ExportError, export_hf
    from transduce.model import Transformer

    vocab = Tokenizer(tiny_corpus / "spm.model").vocab_size
    model = Transformer(preset("tiny", src_vocab_size=vocab, tgt_vocab_size=vocab,
                               positional="t5", norm_first=True, norm="rms",
                               tie_embeddings="decoder", gated_ffn=True, activation="gelu"))
    path = checkpoint.save(tmp_path / "ckpt", model.eval(), None, tiny_corpus / "spm.model")
    with pytest.raises(ExportError) as error:
        export_hf(path, tmp_path / "out")
    for problem in ("cannot export to T5", "bias=True (T5 has no biases)",
                    "tie_embeddings='decoder'", "activation='gelu' with gated_ffn=True"):
        assert problem in str(error.value)
    assert not (tmp_path / "out").exists()


def test_sentinels_that_spiece_model_holds_are_not_added_again(tmp_path):
    """mT5's spiece.model holds ▁<extra_id_0> ... as pieces of its own (and no extra_ids):
    they keep their ids, and no more are added."""
    directory = tmp_path / "hf"
    directory.mkdir()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 20), model_prefix=str(directory / "spiece"),
        vocab_size=80, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        user_defined_symbols=["\u2581<extra_id_1>", "\u2581<extra_id_0>"], minloglevel=2,
        hard_vocab_limit=False)
    pieces = spm.SentencePieceProcessor(model_file=str(directory / "spiece.model"))
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=pieces.get_piece_size() + 3, d_model=16, d_kv=4, d_ff=24, num_layers=1,
        num_heads=4, decoder_start_token_id=0)).save_pretrained(directory)
    ours = Tokenizer(import_t5(directory, tmp_path / "ours") / checkpoint.TOKENIZER)
    assert ours.vocab_size == pieces.get_piece_size() + 1           # + our bos
    text = "The <extra_id_0> walks"
    assert [ours.piece(i) for i in ours.encode([text])[0]] == pieces.encode(text, out_type=str)
    assert "\u2581<extra_id_0>" in pieces.encode(text, out_type=str)


def test_the_onnx_export_translates_as_we_do(t5, tmp_path):
    """T5's bias is computed inside the graphs from the inputs' sizes: sources and
    outputs longer than the export's example (past the exact buckets) translate alike."""
    pytest.importorskip("onnxruntime")
    from transduce.export.onnx import export_onnx

    out = t5[4]
    exported = export_onnx(out, tmp_path / "onnx")
    texts = SAMPLES + [" ".join(TEXTS)]                     # 60-odd source tokens
    for beam in (1, 3):
        assert Translator.load(exported).translate(texts, beam=beam, max_length=40) == \
            Translator.load(out, dtype="float32").translate(texts, beam=beam, max_length=40)
