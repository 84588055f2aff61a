"""`import hf-deberta`: DebertaV2Model and its masked-LM, sequence-classification,
token-classification and question-answering models compute what transformers computes
on padded rows longer than the relative positions' reach, a pre-trained checkpoint's
own masked-LM head is read and its replaced-token head left out, pairs are tokenized
(from tokenizer.json, or spm.model alone) and classified as transformers does through
PyTorch and ONNX Runtime, the import fine-tunes on transformers' loss, `export hf` writes
a DeBERTa again, and what ours cannot hold is refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.foreign_checkpoints import assert_a_classification_batch_gives_transformers_loss, \
    hf_outputs
from tests.test_import_distilbert import LABELS, randomised
from transduce.cli import main
from transduce.importers import ForeignCheckpointError, fresh_heads, import_deberta
from transduce.importers.hf_bert import dropped_heads
from transduce.model import load_model

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

# DeBERTa-v3's layout at a small size: distances bucketed exactly up to 4, then
# logarithmically up to 20, and clamped beyond (rows of 40 tokens reach past it).
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=64, relative_attention=True, position_buckets=8,
             max_relative_positions=20, position_biased_input=False,
             pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm",
             type_vocab_size=0, layer_norm_eps=1e-7)
KINDS = ["DebertaV2Model", "DebertaV2ForMaskedLM", "DebertaV2ForSequenceClassification",
         "DebertaV2ForTokenClassification", "DebertaV2ForQuestionAnswering"]
TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
        "a stitch in time saves nine", "all that glitters is not gold"] * 50


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    """A SentencePiece unigram model with DeBERTa-v3's special pieces: [PAD] 0, [CLS] 1,
    [SEP] 2, [UNK] 3, then [MASK]."""
    directory = tmp_path_factory.mktemp("deberta-spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_prefix=str(directory / "spm"), vocab_size=45,
        model_type="unigram", pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="[PAD]",
        bos_piece="[CLS]", eos_piece="[SEP]", unk_piece="[UNK]",
        user_defined_symbols=["[MASK]"], minloglevel=2)
    (directory / "spm.vocab").unlink()
    return directory


def hf_checkpoint(directory, kind, spm_dir, labels=LABELS, **config):
    """A random transformers DebertaV2* model saved with save_pretrained, with its
    tokenizer (converted from spm.model by transformers, written as tokenizer.json); a
    classifier's classes are `labels`."""
    fast = transformers.DebertaV2TokenizerFast.from_pretrained(str(spm_dir))
    torch.manual_seed(0)
    hf_config = transformers.DebertaV2Config(vocab_size=len(fast) + 7, initializer_range=0.2,
                                             pad_token_id=fast.pad_token_id,
                                             **{**SIZES, **config})
    if kind.endswith("SequenceClassification") or kind.endswith("TokenClassification"):
        hf_config.id2label, hf_config.label2id = labels, {v: k for k, v in labels.items()}
    model = randomised(getattr(transformers, kind)(hf_config).eval())
    model.save_pretrained(directory)
    fast.save_pretrained(str(directory))
    return model


def padded(hf_config, lengths=(40, 12, 1), seed=0):
    """Right-padded rows [CLS] ... [SEP] ... [SEP] of random pieces, longer than the
    relative positions reach, and the real tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, hf_config.vocab_size, (len(lengths), max(lengths)),
                        generator=generator)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    ids[:, 0] = 1                                                      # [CLS]
    for row, n in enumerate(lengths):
        if n > 1:
            ids[row, n - 1] = ids[row, n // 2] = 2                     # [SEP]
    return ids.masked_fill(~mask, hf_config.pad_token_id), mask


@pytest.fixture(scope="module", params=KINDS)
def imported(request, spm_dir, tmp_path_factory):
    """(kind, HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    root = tmp_path_factory.mktemp("deberta")
    hf = hf_checkpoint(root / "hf", request.param, spm_dir)
    out = import_deberta(root / "hf", root / "ours")
    return request.param, hf, load_model(out), out


def test_the_layout_is_deberta_s(imported):
    _, hf, ours, _ = imported
    c = ours.config
    assert (c.positional, c.position_buckets, c.max_positions) == ("disentangled", 8, 64)
    assert (c.max_relative_positions, c.relative_reach) == (20, 20)
    assert (c.type_vocab_size, c.pooler_activation, c.layer_norm_eps) == (0, "gelu", 1e-7)
    assert ours.embed.positions is None and ours.embed.segments is None
    assert (c.pad_id, c.src_vocab_size) == (hf.config.pad_token_id, hf.config.vocab_size)


@pytest.mark.parametrize("impl", ["sdpa", "naive"])
def test_outputs_match_transformers(imported, impl):
    kind, hf, ours, out = imported
    for layer in ours.encoder.layers:
        layer.self_attn.impl = impl
    ids, mask = padded(hf.config)
    result = hf_outputs(hf, ids, mask)
    with torch.no_grad():
        hidden = ours(ids)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[mask], result.hidden_states[-1][mask], **close)
    if kind == "DebertaV2ForMaskedLM":
        torch.testing.assert_close(ours.mlm_logits(hidden)[mask], result.logits[mask], **close)
    if kind == "DebertaV2ForSequenceClassification":
        torch.testing.assert_close(ours.classify_logits(ours.pool(hidden)), result.logits,
                                   **close)
        assert ours.labels == list(LABELS.values())
    if kind == "DebertaV2ForTokenClassification":
        torch.testing.assert_close(ours.tag_logits(hidden)[mask], result.logits[mask], **close)
    if kind == "DebertaV2ForQuestionAnswering":
        spans = ours.span_logits(hidden)
        torch.testing.assert_close(spans[..., 0][mask], result.start_logits[mask], **close)
        torch.testing.assert_close(spans[..., 1][mask], result.end_logits[mask], **close)
    assert fresh_heads(out) == {"DebertaV2ForMaskedLM": ["pooler"],
                                "DebertaV2ForSequenceClassification": ["mlm_head"]}.get(
        kind, ["pooler", "mlm_head"])


def test_a_pretrained_checkpoint_s_own_heads_are_read_and_its_detector_left_out(spm_dir,
                                                                               tmp_path):
    """microsoft's releases: the masked-LM head under DeBERTa's own names (legacy false:
    lm_predictions.lm_head.*) beside the replaced-token detector (mask_predictions.*),
    which ours has no place for."""
    hf = hf_checkpoint(tmp_path / "hf", "DebertaV2ForMaskedLM", spm_dir, legacy=False)
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    assert "lm_predictions.lm_head.dense.weight" in tensors
    tensors |= {"mask_predictions.dense.weight": torch.zeros(32, 32),
                "mask_predictions.classifier.weight": torch.zeros(1, 32)}
    save_file(tensors, weights, metadata={"format": "pt"})
    out = import_deberta(tmp_path / "hf", tmp_path / "ours")
    ours = load_model(out)
    assert dropped_heads(out) == ["mask_predictions"]
    ids, mask = padded(hf.config)
    with torch.no_grad():
        logits = ours.mlm_logits(ours(ids))
    torch.testing.assert_close(logits[mask], hf_outputs(hf, ids, mask).logits[mask],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokenizer_files", ["tokenizer.json", "spm.model alone"])
def test_pairs_are_tokenized_and_classified_as_transformers_does(tokenizer_files, spm_dir,
                                                                 tmp_path):
    """[CLS] A [SEP] B [SEP] by `SentenceEncoder.classify` in PyTorch and on the ONNX
    export, against transformers on its own tokenizer's encoding; a directory with
    spm.model alone (microsoft's releases) has it converted."""
    pytest.importorskip("onnxruntime")
    from transduce.decode.encode import SentenceEncoder
    from transduce.export.onnx import export_onnx

    hf = hf_checkpoint(tmp_path / "hf", "DebertaV2ForSequenceClassification", spm_dir)
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    if tokenizer_files == "spm.model alone":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (tmp_path / "hf" / name).unlink()
        (tmp_path / "hf" / "spm.model").write_bytes((spm_dir / "spm.model").read_bytes())
    out = import_deberta(tmp_path / "hf", tmp_path / "ours")
    first = ["hello world", "the quick brown fox jumps over the lazy dog, twice over"]
    second = ["the lazy dog and a stitch in time", "hello"]
    encoded = fast(first, second, padding=True, return_tensors="pt")
    assert encoded["input_ids"].shape[1] > SIZES["max_relative_positions"]
    with torch.no_grad():
        expected = hf(**encoded).logits.softmax(-1)
    for path in (out, export_onnx(out, tmp_path / "onnx")):
        found = SentenceEncoder.load(path).classify(first, pairs=second)
        for prediction, probabilities in zip(found, expected):
            assert list(prediction.probabilities.values()) == pytest.approx(
                probabilities.tolist(), abs=1e-5)


def test_words_are_tagged_as_transformers_tags_them(spm_dir, tmp_path):
    """A token classifier over SentencePiece's pieces (each word's first starts with
    "▁"): every word's tag and probability at its first piece, long lines in chunks of
    whole words (12 positions)."""
    from tests.test_tagging import LINES, TAGS, expected_line
    from transduce.decode.encode import SentenceEncoder

    hf = hf_checkpoint(tmp_path / "hf", "DebertaV2ForTokenClassification", spm_dir,
                       labels=dict(enumerate(TAGS)), max_position_embeddings=12,
                       max_relative_positions=-1)
    encoder = SentenceEncoder.load(import_deberta(tmp_path / "hf", tmp_path / "ours"))
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    tagged_lines = encoder.tag(LINES, batch_tokens=24)
    assert len(fast(LINES[3])["input_ids"]) > 12                  # tagged in chunks
    for line, tagged in zip(LINES, tagged_lines):
        assert [t.word for t in tagged] == line.split()
        if tagged:
            tags, probabilities = expected_line(hf, fast, encoder.tokenizer, line, 10)
            assert [t.tag for t in tagged] == tags, line
            assert [t.probability for t in tagged] == pytest.approx(probabilities, abs=1e-5)


def test_the_attention_maps_are_transformers_attentions(spm_dir, tmp_path):
    """`transduce attention`'s weights of a pair: transformers' output_attentions,
    layer by layer, disentangled scores and all."""
    from transduce.attention_maps import encoder_attention_maps
    from transduce.decode.encode import SentenceEncoder

    hf = hf_checkpoint(tmp_path / "hf", "DebertaV2Model", spm_dir)
    encoder = SentenceEncoder.load(import_deberta(tmp_path / "hf", tmp_path / "ours"))
    text, pair = "the quick brown fox jumps over the lazy dog", "hello world, hello there"
    maps = encoder_attention_maps(encoder, text, pair)
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        expected = hf(**fast(text, pair, return_tensors="pt"), output_attentions=True)
    assert maps.source_tokens == fast.convert_ids_to_tokens(fast(text, pair)["input_ids"])
    assert expected.attentions[0].shape[-1] > SIZES["max_relative_positions"]   # past reach
    for ours, theirs in zip(maps.encoder, expected.attentions, strict=True):
        torch.testing.assert_close(ours, theirs[0], atol=1e-6, rtol=1e-5)


def test_fine_tuning_the_import_gives_transformers_loss(spm_dir, tmp_path):
    hf = hf_checkpoint(tmp_path / "hf", "DebertaV2ForSequenceClassification", spm_dir,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    out = import_deberta(tmp_path / "hf", tmp_path / "ours")
    labelled = [("positive", "hello world, hello there"), ("negative", "all that glitters"),
                ("neutral", "the quick brown fox jumps over the lazy dog and runs on")]
    assert_a_classification_batch_gives_transformers_loss(hf.train(), out, labelled,
                                                          tmp_path, hf.config.pad_token_id)


@pytest.mark.parametrize("kind", ["DebertaV2ForSequenceClassification", "DebertaV2ForMaskedLM",
                                  "DebertaV2ForTokenClassification",
                                  "DebertaV2ForQuestionAnswering"])
def test_export_hf_is_deberta_again(kind, spm_dir, tmp_path, capsys):
    hf = hf_checkpoint(tmp_path / "hf", kind, spm_dir)
    out = import_deberta(tmp_path / "hf", tmp_path / "ours")
    assert main(["export", "hf", str(out), str(tmp_path / "back")]) == 0
    assert f"({kind}: load it with" in capsys.readouterr().out
    back = getattr(transformers, kind).from_pretrained(tmp_path / "back").eval()
    theirs = back.state_dict()
    assert sorted(theirs) == sorted(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    ids, mask = padded(hf.config)
    torch.testing.assert_close(hf_outputs(back, ids, mask).hidden_states[-1],
                               hf_outputs(hf, ids, mask).hidden_states[-1])
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert fast("hello world", "the dog")["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(
            "hello world", "the dog")["input_ids"]


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "deberta"}, r"model_type='deberta'; only 'deberta-v2'"),
    ({"relative_attention": False}, r"relative_attention=False is not supported"),
    ({"position_biased_input": True}, r"position_biased_input=True is not supported"),
    ({"share_att_key": False}, r"share_att_key=False is not supported"),
    ({"norm_rel_ebd": "none"}, r"norm_rel_ebd='none' is not supported"),
    ({"conv_kernel_size": 3}, r"conv_kernel_size=3 is not supported"),
    ({"pos_att_type": ["c2p"]}, r"pos_att_type=\['c2p'\]: ours adds both"),
    ({"position_buckets": -1}, r"position_buckets=-1: ours buckets"),
    ({"embedding_size": 16}, r"embedding_size=16 where the layers' gives 32"),
    ({"hidden_act": "quick_gelu"}, r"hidden_act='quick_gelu' is not supported"),
    ({"architectures": ["DebertaV2ForMultipleChoice"]}, r"a multiple-choice model"),
    ({"pad_token_id": 1}, r"pad_token_id=1 but the tokenizer's pad token '\[PAD\]'"),
    ({"vocab_size": 10}, r"vocab_size=10 is smaller than the tokenizer's"),
])
def test_what_ours_cannot_hold_is_refused_by_name(changes, message, spm_dir, tmp_path,
                                                  capsys):
    hf_checkpoint(tmp_path / "hf", "DebertaV2Model", spm_dir)
    file = tmp_path / "hf" / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))
    with pytest.raises(ForeignCheckpointError, match=message):
        import_deberta(tmp_path / "hf", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()
    assert main(["import", "hf-deberta", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ours")]) != 0
    assert "config.json" in capsys.readouterr().err


def test_export_ct2_is_refused_by_name(spm_dir, tmp_path):
    from transduce.export import export_ctranslate2
    from transduce.export.common import ExportError

    hf_checkpoint(tmp_path / "hf", "DebertaV2Model", spm_dir)
    out = import_deberta(tmp_path / "hf", tmp_path / "ours")
    with pytest.raises(ExportError, match=r"cannot export to CTranslate2: .*"
                                          r"positional='disentangled'"):
        export_ctranslate2(out, tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()
