"""Hugging Face Marian -> our checkpoint: the imported model computes what
transformers.MarianMTModel computes (logits over every token it may output, greedy and
beam translations, as text), its tokenizer gives MarianTokenizer's ids, the exports carry
the output bias, and a checkpoint we cannot reproduce is refused by name with nothing
written."""

import dataclasses
import json
import shutil
import warnings

import pytest
import sentencepiece as spm
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from transduce.decode.translate import Translator
from transduce.importers import import_marian
from transduce.model import load_model
from transduce.model.transformer import NEVER_OUTPUT
from tests.foreign_checkpoints import assert_refused, damaged

transformers = pytest.importorskip("transformers")

SOURCE_TEXT = ["The quick brown fox jumps over the lazy dog.",
               "She sells sea shells by the shore.",
               "How much wood would a woodchuck chuck?", "Peter Piper picked a peck of peppers.",
               "Numbers 12, 345 and 6789; symbols: @#%&*!", "Ünïcödé àéîõü ñ ß café naïve"]
TARGET_TEXT = ["El rápido zorro marrón salta sobre el perro perezoso.",
               "Ella vende conchas junto a la orilla.", "¿Cuánta madera cortaría una marmota?",
               "Pedro Pérez pintor pinta paisajes preciosos.", "Números 12, 345 y 6789."]
SAMPLES = ["The quick brown fox.", "sea shells", ">>fra<< How much wood?",
           ">>deu<< Peter picked peppers", "Numbers: 12 and 345!", "café naïve Ünïcödé",
           "zzzz qqqq xylophone", "a"]
CODES = [">>fra<<", ">>deu<<"]


def _spm(texts, prefix, size):
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts * 20), model_prefix=str(prefix),
                                   vocab_size=size, model_type="unigram", minloglevel=2,
                                   hard_vocab_limit=False)
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def _marian_vocab(*processors, codes=CODES):
    """vocab.json as Marian's converter writes it: </s>, <unk>, then the pieces of the
    processors (language codes first here), <pad> last."""
    pieces = ["</s>", "<unk>"] + codes
    for processor in processors:
        for i in range(processor.get_piece_size()):
            piece = processor.id_to_piece(i)
            if not (processor.is_control(i) or processor.is_unknown(i)) and piece not in pieces:
                pieces.append(piece)
    return {piece: i for i, piece in enumerate(pieces + ["<pad>"])}


def write_marian(directory, separate=False, **config_changes):
    """A small random MarianMTModel with its tokenizer files -> (directory, vocab); with
    `separate`, a vocabulary for each side (target_vocab.json; each ends with its <pad>,
    and the config's pad is the target's, as Marian's converter writes them: within the
    larger source vocabulary, as transformers needs it)."""
    directory.mkdir()
    source = _spm(SOURCE_TEXT, directory / "source", 70)
    target = _spm(TARGET_TEXT, directory / "target", 60 if separate else 70)
    (directory / "source.model").rename(directory / "source.spm")
    (directory / "target.model").rename(directory / "target.spm")
    vocab = _marian_vocab(source) if separate else _marian_vocab(source, target)
    target_vocab = _marian_vocab(target, codes=[]) if separate else vocab
    pad = target_vocab["<pad>"]
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    if separate:
        (directory / "target_vocab.json").write_text(json.dumps(target_vocab, ensure_ascii=False))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "MarianTokenizer", "source_lang": "en", "target_lang": "es",
         "separate_vocabs": separate, "model_max_length": 64}))
    values = dict(vocab_size=len(vocab), decoder_vocab_size=len(target_vocab), d_model=32,
                  share_encoder_decoder_embeddings=not separate,
                  encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                  max_position_embeddings=64, activation_function="swish",
                  scale_embedding=True, pad_token_id=pad, eos_token_id=0,
                  decoder_start_token_id=pad, dropout=0.0, attention_dropout=0.0)
    values.update(config_changes)
    torch.manual_seed(7)
    model = transformers.MarianMTModel(transformers.MarianConfig(**values)).eval()
    with torch.no_grad():   # norms, biases and the logits' bias away from their init
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(0.3 * torch.randn_like(parameter))
        for stack, pad_id in ((model.model.encoder, vocab["<pad>"]),
                              (model.model.decoder, pad)):     # shared: one matrix
            stack.embed_tokens.weight.normal_(0.0, 0.3)
            stack.embed_tokens.weight[pad_id] = 0.0    # as Marian's converter leaves it
        model.final_logits_bias.normal_(0.0, 0.3)
        # Trained models do not output language codes (ours would decode with a space).
        model.final_logits_bias[0, [target_vocab[c] for c in CODES if c in target_vocab]] = -10.0
    model.save_pretrained(directory)
    return directory, vocab


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    """(the Marian directory, its vocab, its model, its tokenizer, our import)."""
    root = tmp_path_factory.mktemp("marian")
    directory, vocab = write_marian(root / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.MarianMTModel.from_pretrained(directory).eval()
        tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    return directory, vocab, theirs, tokenizer, import_marian(directory, root / "ours")


def marian_id_of(tokenizer: Tokenizer, vocab) -> list[int]:
    """Per id of ours, the Marian id of the same piece (by name: a language code's piece
    of ours starts with the word boundary), -1 for pad and bos."""
    ids = []
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.piece(i)
        piece = piece[1:] if piece.startswith("\u2581>>") else piece
        ids.append(-1 if i in (PAD_ID, BOS_ID) else vocab[piece])
    return ids


def test_the_tokenizer_gives_marians_ids(marian):
    directory, vocab, _, theirs, out = marian
    ours = Tokenizer(out / checkpoint.TOKENIZER)
    to_marian = marian_id_of(ours, vocab)
    for text in SAMPLES:
        mapped = [to_marian[i] for i in ours.encode([text])[0] + [EOS_ID]]
        assert mapped == theirs(text)["input_ids"], text


def test_targets_are_segmented_as_target_spm_segments_them(marian):
    """MarianTokenizer segments references (text_target) with target.spm: a fine-tuning
    run's targets must be pieces the model learnt to output, not source.spm's."""
    _, vocab, _, theirs, out = marian
    ours = Tokenizer(out / checkpoint.TOKENIZER)
    targets = ours.target_tokenizer
    assert targets.path.name == checkpoint.TARGET_TOKENIZER
    to_marian = marian_id_of(ours, vocab)
    assert [[to_marian[i] for i in ids] + [vocab["</s>"]] for ids in targets.encode(TARGET_TEXT)] \
        == theirs(text_target=TARGET_TEXT)["input_ids"]
    assert targets.encode(TARGET_TEXT) != ours.encode(TARGET_TEXT)
    assert targets.fingerprint != ours.fingerprint


def test_a_target_model_of_other_pieces_is_refused(marian, tmp_path, tiny_corpus):
    """The import shares one matrix: a target vocabulary of other pieces is not its own."""
    from transduce.data.tokenizer import TokenizerError
    from transduce.decode.translate import Translator

    copy = tmp_path / "copy"
    shutil.copytree(marian[4], copy)
    shutil.copyfile(tiny_corpus / "spm.model", copy / checkpoint.TARGET_TOKENIZER)
    with pytest.raises(TokenizerError, match=r"spm-target.model: a separate target vocabulary "
                                             r".*\(tie_embeddings='all'\)"):
        Translator.load(copy)


def test_the_hugging_face_export_keeps_segmentations_codes_and_languages(marian, tmp_path):
    from transduce.export import export_hf

    directory, _, _, theirs, out = marian
    exported = export_hf(out, tmp_path / "hf")
    again = transformers.MarianTokenizer.from_pretrained(exported)
    for texts in ({"text": SAMPLES}, {"text_target": TARGET_TEXT}):
        assert [again.convert_ids_to_tokens(ids) for ids in again(**texts)["input_ids"]] == \
            [theirs.convert_ids_to_tokens(ids) for ids in theirs(**texts)["input_ids"]]
    imported = import_marian(exported, tmp_path / "back")
    assert checkpoint.read_languages(imported) == ("en", "es")
    back, first = Tokenizer(imported / checkpoint.TOKENIZER), Tokenizer(out / checkpoint.TOKENIZER)
    assert back.encode(SAMPLES) == first.encode(SAMPLES)
    assert back.target_tokenizer.encode(TARGET_TEXT) == first.target_tokenizer.encode(TARGET_TEXT)


def _batch(tokenizer, texts):
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


def logits_both_ways(theirs, tokenizer, out, vocab, target_vocab):
    """Our import's logits and Marian's, for SAMPLES[:4] and random targets -> (ours,
    Marian's in our target ids' order past pad and bos, Marian's source and mask)."""
    ours = Tokenizer(out / checkpoint.TOKENIZER)
    to_source = {m: i for i, m in enumerate(marian_id_of(ours, vocab)) if m >= 0}
    to_marian = torch.tensor(marian_id_of(ours.target_tokenizer, target_vocab))
    to_target = {int(m): i for i, m in enumerate(to_marian.tolist()) if m >= 0}
    their_src, mask = _batch(tokenizer, SAMPLES[:4])
    src = their_src.clone().apply_(lambda t: to_source.get(t, PAD_ID)).masked_fill(
        mask == 0, PAD_ID)
    torch.manual_seed(1)
    outputs = torch.randint(2, len(target_vocab) - 1, (4, 6))
    their_tgt = torch.cat([torch.full((4, 1), target_vocab["<pad>"]), outputs], dim=1)
    tgt = torch.cat([torch.full((4, 1), BOS_ID), outputs.clone().apply_(to_target.get)], dim=1)
    with torch.no_grad():
        expected = theirs(input_ids=their_src, attention_mask=mask,
                          decoder_input_ids=their_tgt).logits
        found = load_model(out)(src, tgt)
    return found, expected[..., to_marian[2:]], (their_src, mask)


def test_logits_match_over_every_token_it_may_output(marian):
    directory, vocab, theirs, tokenizer, out = marian
    found, expected, _ = logits_both_ways(theirs, tokenizer, out, vocab, vocab)
    torch.testing.assert_close(found[..., 2:], expected, rtol=1e-4, atol=1e-4)
    assert torch.all(found[..., [PAD_ID, BOS_ID]] <= NEVER_OUTPUT / 2)      # never output


def _generate(theirs, tokenizer, texts, **options):
    src, mask = _batch(tokenizer, texts)
    with torch.no_grad():
        out = theirs.generate(input_ids=src, attention_mask=mask, max_new_tokens=10,
                              do_sample=False, forced_eos_token_id=None, **options)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def test_greedy_and_beam_translations_are_marians(marian):
    _, _, theirs, tokenizer, out = marian
    translator = Translator.load(out)
    assert translator.translate(SAMPLES, beam=1, max_length=10) == \
        _generate(theirs, tokenizer, SAMPLES, num_beams=1)
    # Without a length penalty both rank finished hypotheses by log-probability.
    assert translator.translate(SAMPLES, beam=4, alpha=0.0, max_length=10) == \
        _generate(theirs, tokenizer, SAMPLES, num_beams=4, length_penalty=0.0,
                  early_stopping=True)


def test_a_bfloat16_copy_keeps_the_never_output_bias_finite(marian):
    """float32's lowest number would round to -inf in bfloat16, and 0 * -inf is NaN."""
    bias = Translator.load(marian[4], dtype="bfloat16").model.output_proj.bias
    assert bias.dtype == torch.bfloat16 and torch.isfinite(bias).all()
    assert torch.all(bias[[PAD_ID, BOS_ID]] == NEVER_OUTPUT)


def test_the_checkpoint_records_the_languages_and_what_it_came_from(marian):
    directory, _, _, _, out = marian
    config = json.loads((out / "config.json").read_text())
    assert config["languages"] == {"source": "en", "target": "es"}
    assert config["origin"]["imported"] == "hf-marian"
    assert config["origin"]["source_pieces_not_in_vocabulary"] == 0
    assert config["model"]["activation"] == "silu" and config["model"]["output_bias"]


def test_exports_carry_the_output_bias(marian, tmp_path):
    from transduce.export import export_hf

    _, _, _, tokenizer, out = marian
    model = load_model(out)
    exported = export_hf(out, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = transformers.MarianMTModel.from_pretrained(exported).eval()
    src = torch.tensor([Tokenizer(out / checkpoint.TOKENIZER).encode([SAMPLES[0]])[0] + [EOS_ID]])
    tgt = torch.tensor([[BOS_ID, 5, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=src, decoder_input_ids=tgt).logits,
                                   model(src, tgt), rtol=1e-4, atol=1e-4)


def test_the_ctranslate2_export_translates_as_we_do(marian, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transduce.export import export_ctranslate2

    _, _, _, _, out = marian
    exported = export_ctranslate2(out, tmp_path / "ct2")
    ours = Tokenizer(out / checkpoint.TOKENIZER)
    translator = ctranslate2.Translator(str(exported), device="cpu", intra_threads=1)
    pieces = [[ours.piece(i) for i in ids] for ids in ours.encode(SAMPLES)]
    found = translator.translate_batch(pieces, beam_size=1, max_decoding_length=10,
                                       min_decoding_length=0)
    texts = [ours.decode([ours.processor.piece_to_id(p) for p in r.hypotheses[0]]) for r in found]
    assert texts == Translator.load(out).translate(SAMPLES, beam=1, max_length=10)


@pytest.fixture(scope="module")
def separate(tmp_path_factory):
    """(the Marian directory with separate vocabularies, vocab, target vocab, its model,
    its tokenizer, our import)."""
    root = tmp_path_factory.mktemp("separate")
    directory, vocab = write_marian(root / "hf", separate=True)
    target_vocab = json.loads((directory / "target_vocab.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.MarianMTModel.from_pretrained(directory).eval()
        tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    return directory, vocab, target_vocab, theirs, tokenizer, import_marian(directory,
                                                                            root / "ours")


def test_separate_vocabularies_give_marians_ids_on_each_side(separate):
    _, vocab, target_vocab, _, theirs, out = separate
    ours = Tokenizer(out / checkpoint.TOKENIZER)
    assert ours.separate and len(vocab) != len(target_vocab)
    assert vocab["<pad>"] != target_vocab["<pad>"]
    for side, marian_vocab, texts in ((ours, vocab, {"text": SAMPLES}),
                                      (ours.target_tokenizer, target_vocab,
                                       {"text_target": TARGET_TEXT})):
        to_marian = marian_id_of(side, marian_vocab)
        assert [[to_marian[i] for i in ids + [EOS_ID]] for ids in side.encode(
            next(iter(texts.values())))] == theirs(**texts)["input_ids"]
    config = load_model(out).config
    # each with a bos of ours, which Marian's vocabularies lack
    assert (config.src_vocab_size, config.tgt_vocab_size, config.tie_embeddings) == \
        (len(vocab) + 1, len(target_vocab) + 1, "decoder")


def test_separate_vocabularies_give_marians_logits_and_translations(separate):
    _, vocab, target_vocab, theirs, tokenizer, out = separate
    found, expected, (their_src, mask) = logits_both_ways(theirs, tokenizer, out, vocab,
                                                          target_vocab)
    torch.testing.assert_close(found[..., 2:], expected, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        generated = theirs.generate(input_ids=their_src, attention_mask=mask, max_new_tokens=10,
                                    do_sample=False, num_beams=1, forced_eos_token_id=None)
    # (the start token left out: its <pad> is the target's, which the tokenizer does not
    # know as its special token)
    assert Translator.load(out).translate(SAMPLES[:4], beam=1, max_length=10) == \
        tokenizer.batch_decode(generated[:, 1:], skip_special_tokens=True)


def test_separate_vocabularies_need_a_matrix_each_and_their_files(tmp_path):
    directory, _ = write_marian(tmp_path / "base", separate=True)
    bad = damaged(directory, tmp_path, config=lambda c: {
        **c, "share_encoder_decoder_embeddings": True, "vocab_size": c["decoder_vocab_size"]})
    assert_refused(import_marian, bad, tmp_path, "separate_vocabs=true needs "
                                                 "share_encoder_decoder_embeddings=false")
    (directory / "target_vocab.json").unlink()
    assert_refused(import_marian, directory, tmp_path, "no target_vocab.json")


def test_an_encoder_matrix_of_its_own_over_one_vocabulary_is_imported(tmp_path):
    directory, _ = write_marian(tmp_path / "hf", share_encoder_decoder_embeddings=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.MarianMTModel.from_pretrained(directory).eval()
        tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    out = import_marian(directory, tmp_path / "ours")
    model = load_model(out)
    assert model.config.tie_embeddings == "decoder"
    assert not Tokenizer(out / checkpoint.TOKENIZER).separate
    assert not torch.equal(model.encoder.embed.embedding.weight,
                           model.decoder.embed.embedding.weight)
    assert Translator.load(out).translate(SAMPLES, beam=1, max_length=10) == \
        _generate(theirs, tokenizer, SAMPLES, num_beams=1)


def test_the_command_imports(marian, tmp_path, capsys):
    assert main(["import", "hf-marian", str(marian[0]), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "encoder-decoder: 2 + 2 layers" in printed and "en -> es" in printed


def test_an_imported_model_fine_tunes_on_a_corpus_of_ones_own(marian, tmp_path, tiny_corpus,
                                                             capsys):
    """A corpus without a vocabulary of its own is read with the checkpoint's (both
    segmentations, kept in every checkpoint, and read again when the run resumes); the
    output bias stays as imported, as transformers keeps final_logits_bias (a buffer)."""
    out = marian[4]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for file in tiny_corpus.iterdir():
        if file.is_file() and not file.name.startswith("spm."):
            (corpus / file.name).write_bytes(file.read_bytes())
    args = ["train", "--data", str(corpus), "--init", str(out), "--max-steps", "6",
            "--eval-every", "6", "--save-every", "3", "--log-every", "3"]
    assert main(args + ["--out", str(tmp_path / "run")]) == 0
    for step in checkpoint.list_checkpoints(tmp_path / "run"):
        for name in (checkpoint.TOKENIZER, checkpoint.TARGET_TOKENIZER):
            assert (step / name).read_bytes() == (out / name).read_bytes()
    shutil.rmtree(checkpoint.resolve(tmp_path / "run"))
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--resume",
                 "--max-steps", "6", "--eval-every", "6", "--save-every", "3"]) == 0
    tuned = load_model(tmp_path / "run")
    before = load_model(out)
    assert torch.all(tuned.output_proj.bias[[PAD_ID, BOS_ID]] == NEVER_OUTPUT)
    assert torch.equal(tuned.output_proj.bias, before.output_proj.bias)
    assert not tuned.output_proj.bias.requires_grad
    assert not torch.equal(tuned.output_proj.weight, before.output_proj.weight)
    assert main(["average", str(tmp_path / "run"), "--out", str(tmp_path / "average")]) == 0
    for written in (checkpoint.resolve(tmp_path / "run"), tmp_path / "average"):
        for name in (checkpoint.TOKENIZER, checkpoint.TARGET_TOKENIZER):
            assert (written / name).read_bytes() == (out / name).read_bytes()
    (corpus / "spm.model").write_bytes((tiny_corpus / "spm.model").read_bytes())
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "again")]) == 1
    assert "is not the vocabulary" in capsys.readouterr().err


def test_a_pytorch_model_bin_imports_as_its_safetensors_do(marian, tmp_path):
    """Older OPUS-MT directories hold pytorch_model.bin only."""
    from safetensors.torch import load_file

    directory = tmp_path / "bin"
    shutil.copytree(marian[0], directory)
    weights = directory / "model.safetensors"
    torch.save(load_file(str(weights)), directory / "pytorch_model.bin")
    weights.unlink()
    ours = load_model(import_marian(directory, tmp_path / "out")).state_dict()
    assert all(torch.equal(ours[name], weight)
               for name, weight in load_model(marian[4]).state_dict().items())


def test_float16_weights_and_stored_position_tables_import(marian, tmp_path):
    """transformers' converter saves OPUS-MT models in float16, and older directories
    hold the position tables too (which float16 rounds by up to 2.4e-4)."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "half"
    shutil.copytree(marian[0], directory)
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    table = marian[2].model.encoder.embed_positions.weight.detach()
    for stack in ("encoder", "decoder"):
        tensors[f"model.{stack}.embed_positions.weight"] = table.clone()
    save_file({name: tensor.half() for name, tensor in tensors.items()}, str(weights))
    half = load_model(import_marian(directory, tmp_path / "out")).state_dict()
    for name, weight in load_model(marian[4]).state_dict().items():
        rounded = weight.half().float()
        if name == "output_proj.bias":        # never-output tokens are set, not read
            rounded = torch.where(weight == NEVER_OUTPUT, weight, rounded)
        assert torch.equal(half[name], rounded), name


def test_old_configurations_keys_import_where_transformers_computes_the_same(marian,
                                                                             tmp_path):
    """Configs written by transformers 3 carry BART's options; add_bias_logits is one
    transformers no longer reads (it adds final_logits_bias either way)."""
    old = {"add_bias_logits": True, "normalize_before": False, "add_final_layer_norm": False,
           "normalize_embedding": False, "static_position_embeddings": True,
           "extra_pos_embeddings": 71, "classif_dropout": 0.0, "num_beams": 4}
    changed = damaged(marian[0], tmp_path, config=lambda values: {**values, **old})
    imported = load_model(import_marian(changed, tmp_path / "out")).state_dict()
    assert all(torch.equal(imported[name], weight)
               for name, weight in load_model(marian[4]).state_dict().items())


def test_an_import_converts_to_multi_query_with_its_vocabularies(marian, tmp_path, capsys):
    out = tmp_path / "mqa"
    assert main(["convert-kv", "--kv-heads", "1", "--out", str(out), str(marian[4])]) == 0
    assert "--max-steps N" in capsys.readouterr().out       # an import records no steps
    for name in (checkpoint.TOKENIZER, checkpoint.TARGET_TOKENIZER):
        assert (out / name).read_bytes() == (marian[4] / name).read_bytes()
    assert torch.equal(load_model(out).output_proj.bias, load_model(marian[4]).output_proj.bias)


def test_fine_tuning_an_import_asks_for_a_budget(marian, tmp_path, tiny_corpus, capsys):
    """An import records no training steps, from which --init would take its budget."""
    assert main(["train", "--data", str(tiny_corpus), "--init", str(marian[4]),
                 "--out", str(tmp_path / "run")]) == 2      # a usage error
    assert "steps are not recorded (an import)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_source_piece_the_vocabulary_lacks_is_counted(tmp_path):
    directory, vocab = write_marian(tmp_path / "hf")
    source = spm.SentencePieceProcessor(model_file=str(directory / "source.spm"))
    lacking = next(piece for piece in map(source.id_to_piece, range(source.get_piece_size()))
                   if len(piece) > 1 and not piece.startswith("<"))
    del vocab[lacking]
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    out = import_marian(directory, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["origin"][
        "source_pieces_not_in_vocabulary"] == 1
    assert lacking not in [Tokenizer(out / checkpoint.TOKENIZER).piece(i) for i in range(
        Tokenizer(out / checkpoint.TOKENIZER).vocab_size)]


REFUSED_CONFIGS = [
    (lambda c: {**c, "model_type": "bart"}, "model_type='bart'"),
    (lambda c: {**c, "activation_function": "tanh"}, "activation_function='tanh'"),
    (lambda c: {**c, "normalize_before": True}, "normalize_before=true"),
    (lambda c: {**c, "decoder_attention_heads": 2}, "our stacks share num_heads"),
    (lambda c: {**c, "decoder_vocab_size": 10}, "decoder_vocab_size=10"),
    (lambda c: {**c, "share_encoder_decoder_embeddings": "no"},
     "share_encoder_decoder_embeddings='no'; expected true or false"),
    (lambda c: {**c, "eos_token_id": 5}, "eos_token_id=5"),
    (lambda c: {**c, "decoder_start_token_id": 10 ** 6}, "decoder_start_token_id=1000000"),
    (lambda c: {**c, "d_model": 33}, "d_model=33"),
]


def _with_other_lm_head(tensors):
    tensors["lm_head.weight"] = tensors["model.shared.weight"] + 1.0


REFUSED_WEIGHTS = [
    (lambda t: {k: v for k, v in t.items() if k != "model.encoder.layers.1.fc2.bias"},
     "missing weight 'encoder.layers.1.fc2.bias'"),
    (lambda t: {**t, "model.extra.weight": torch.zeros(2)}, "unknown weight 'model.extra.weight'"),
    (_with_other_lm_head, "'lm_head.weight' differs from 'shared.weight'"),
    (lambda t: {**t, "model.encoder.embed_positions.weight": torch.zeros(64, 32)},
     "'encoder.embed_positions.weight' is not the sinusoidal table"),
    (lambda t: {**t, "final_logits_bias": torch.zeros(1, 3)},
     "'final_logits_bias' has shape (1, 3)"),
    (lambda t: {**t, "encoder.layers.0.fc1.bias": t["model.encoder.layers.0.fc1.bias"].clone()},
     "is stored twice (with and without the 'model.' prefix)"),
]


@pytest.mark.parametrize("part, change, message",
                         [("config", *case) for case in REFUSED_CONFIGS]
                         + [("weights", *case) for case in REFUSED_WEIGHTS])
def test_configurations_and_weights_we_cannot_reproduce_are_refused_by_name(tmp_path, part,
                                                                            change, message):
    directory, _ = write_marian(tmp_path / "base")
    bad = damaged(directory, tmp_path, **{part: change})
    assert_refused(import_marian, bad, tmp_path, message)


def test_tokenizer_files_we_cannot_read_are_refused(tmp_path):
    directory, _ = write_marian(tmp_path / "base")
    (directory / "vocab.json").unlink()
    assert_refused(import_marian, directory, tmp_path, "no vocab.json")
    directory, _ = write_marian(tmp_path / "separate")
    (directory / "tokenizer_config.json").write_text(json.dumps({"separate_vocabs": True}))
    assert_refused(import_marian, directory, tmp_path, "separate_vocabs=true")
    directory, vocab = write_marian(tmp_path / "no-unk")
    del vocab["<unk>"]
    (directory / "vocab.json").write_text(json.dumps(vocab))
    assert_refused(import_marian, directory, tmp_path, "no unk piece '<unk>'")


def test_bad_words_are_never_output(tmp_path):
    directory, vocab = write_marian(tmp_path / "base")
    bad = damaged(directory, tmp_path, config=lambda c: {**c, "bad_words_ids": [[10], [4, 5]]})
    (bad / "generation_config.json").write_text(json.dumps({"bad_words_ids": [[12]]}))
    out = import_marian(bad, tmp_path / "out")
    bias = load_model(out).output_proj.bias
    ours = Tokenizer(out / checkpoint.TOKENIZER)
    never = [i for i in range(ours.vocab_size) if bias[i] == NEVER_OUTPUT]
    assert sorted(marian_id_of(ours, vocab)[i] for i in never) == [-1, -1, 10, 12]


def test_our_marian_export_imports_back_to_the_same_model(tmp_path, tiny_corpus):
    from tests.test_export import saved_model
    from transduce.export import export_hf

    model, path = saved_model(tmp_path, tiny_corpus, activation="silu", dropout=0.2,
                              attention_dropout=0.1)
    back = import_marian(export_hf(path, tmp_path / "hf"), tmp_path / "back")
    # the same configuration, dropout included (a fine-tuning run trains with it)
    assert dataclasses.replace(load_model(back).config, output_bias=False) == model.config
    ours, theirs = Tokenizer(path / checkpoint.TOKENIZER), Tokenizer(back / checkpoint.TOKENIZER)
    assert [theirs.piece(i) for i in range(theirs.vocab_size)] == \
        [ours.piece(i) for i in range(ours.vocab_size)]
    assert theirs.encode(SAMPLES) == ours.encode(SAMPLES)
    imported = load_model(back).state_dict()
    bias = imported.pop("output_proj.bias")
    assert imported.keys() == model.state_dict().keys()
    assert all(torch.equal(imported[name], weight) for name, weight in model.state_dict().items())
    assert torch.all(bias[2:] == 0) and torch.all(bias[:2] == NEVER_OUTPUT)
    assert not (back / checkpoint.TARGET_TOKENIZER).exists()    # one segmentation for both


def test_the_onnx_export_translates_as_we_do(marian, tmp_path):
    pytest.importorskip("onnxruntime")
    from transduce.export.onnx import export_onnx

    out = marian[4]
    exported = export_onnx(out, tmp_path / "onnx")
    ours = Translator.load(out).translate(SAMPLES, beam=2, max_length=10)
    assert Translator.load(exported).translate(SAMPLES, beam=2, max_length=10) == ours
