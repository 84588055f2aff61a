"""`import hf-modernbert`: ModernBertModel and its masked-LM, sequence-classification
(over [CLS] or the mean of the tokens), token-classification and question-answering
models compute what transformers computes on padded rows longer than the sliding window,
config.json's older keys read as its newer ones, pairs are tokenized and classified as
transformers does through PyTorch and ONNX Runtime, the import fine-tunes on transformers'
loss, `export hf` writes a ModernBERT again, a sentence-transformers model on it embeds
as it does, and what ours cannot hold is refused by name."""

import json

import numpy as np
import pytest
import torch

from tests.foreign_checkpoints import assert_a_classification_batch_gives_transformers_loss, \
    hf_outputs
from tests.test_import_distilbert import LABELS, randomised
from transduce.cli import main
from transduce.importers import ForeignCheckpointError, fresh_heads, import_modernbert
from transduce.model import load_model

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
# 4 layers: 0 and 3 full (one in three), 1 and 2 sliding over 4 tokens each side, each
# kind with its own rotary base; the vocabulary has unused ids after the tokenizer's.
SIZES = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
             intermediate_size=40, local_attention=8, max_position_embeddings=64,
             global_attn_every_n_layers=3, global_rope_theta=160_000.0,
             local_rope_theta=10_000.0)
KINDS = ["ModernBertModel", "ModernBertForMaskedLM", "ModernBertForSequenceClassification",
         "ModernBertForTokenClassification", "ModernBertForQuestionAnswering"]
TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
        "a stitch in time saves nine", "all that glitters is not gold"] * 20


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json as ModernBERT's: its special tokens after the
    pieces, [CLS] A [SEP] (B [SEP]) as its template, [MASK] taking the space before it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, \
        processors, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_special_tokens([AddedToken(token, lstrip=token == "[MASK]") for token in SPECIALS])
    cls, sep = bpe.token_to_id("[CLS]"), bpe.token_to_id("[SEP]")
    bpe.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, **{f"{name}_token": f"[{name.upper()}]"
                                 for name in ("unk", "cls", "sep", "pad", "mask")})
    directory = tmp_path_factory.mktemp("modernbert-tokenizer")
    fast.save_pretrained(str(directory))
    return directory


def hf_checkpoint(directory, kind, tokenizer_dir, **config):
    """A random transformers ModernBert* model saved with save_pretrained, with its
    tokenizer's files."""
    fast = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    ids = {f"{name}_token_id": fast.convert_tokens_to_ids(f"[{name.upper()}]")
           for name in ("pad", "cls", "sep")}
    hf_config = transformers.ModernBertConfig(vocab_size=len(fast) + 11, initializer_range=0.2,
                                              bos_token_id=ids["cls_token_id"],
                                              eos_token_id=ids["sep_token_id"],
                                              **ids, **{**SIZES, **config})
    if kind.endswith("SequenceClassification") or kind.endswith("TokenClassification"):
        hf_config.id2label, hf_config.label2id = LABELS, {v: k for k, v in LABELS.items()}
    model = randomised(getattr(transformers, kind)(hf_config).eval())
    model.save_pretrained(directory)
    fast.save_pretrained(str(directory))
    return model


def padded(hf_config, lengths=(23, 12, 1), seed=0):
    """Right-padded rows [CLS] ... [SEP] ... [SEP] of random pieces, longer than the
    window, and the real tokens."""
    generator = torch.Generator().manual_seed(seed)
    regular = hf_config.pad_token_id - 3                     # the pieces before [UNK]
    ids = torch.randint(0, regular, (len(lengths), max(lengths)), generator=generator)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    ids[:, 0] = hf_config.cls_token_id
    for row, n in enumerate(lengths):
        if n > 1:
            ids[row, n - 1] = ids[row, n // 2] = hf_config.sep_token_id
    return ids.masked_fill(~mask, hf_config.pad_token_id), mask


@pytest.fixture(scope="module", params=KINDS)
def imported(request, tokenizer_dir, tmp_path_factory):
    """(kind, HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    root = tmp_path_factory.mktemp("modernbert")
    hf = hf_checkpoint(root / "hf", request.param, tokenizer_dir)
    out = import_modernbert(root / "hf", root / "ours")
    return request.param, hf, load_model(out), out


def test_the_layout_is_modernbert_s(imported):
    _, hf, ours, _ = imported
    c = ours.config
    assert (c.norm_first, c.positional, c.gated_ffn, c.bias, c.norm_bias) == \
        (True, "rotary", True, False, False)
    assert (c.attention_type, c.attention_window, c.full_attention_layers) == \
        ("sliding", 4, (0, 3))
    assert (c.rope_base, c.local_rope_base, c.prediction_head) == (160_000.0, 10_000.0, True)
    assert isinstance(ours.encoder.layers[0].norm1, torch.nn.Identity)
    assert (c.pad_id, c.src_vocab_size) == (hf.config.pad_token_id, hf.config.vocab_size)


def test_outputs_match_transformers(imported):
    kind, hf, ours, out = imported
    ids, mask = padded(hf.config)
    result = hf_outputs(hf, ids, mask)
    with torch.no_grad():
        hidden = ours(ids)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[mask], result.hidden_states[-1][mask], **close)
    if kind == "ModernBertForMaskedLM":
        torch.testing.assert_close(ours.mlm_logits(hidden)[mask], result.logits[mask], **close)
    if kind == "ModernBertForSequenceClassification":
        torch.testing.assert_close(ours.classify_logits(ours.pool(hidden, ids)),
                                   result.logits, **close)
        assert ours.labels == list(LABELS.values())
    if kind == "ModernBertForTokenClassification":
        torch.testing.assert_close(ours.tag_logits(hidden)[mask], result.logits[mask], **close)
    if kind == "ModernBertForQuestionAnswering":
        spans = ours.span_logits(hidden)
        torch.testing.assert_close(spans[..., 0][mask], result.start_logits[mask], **close)
        torch.testing.assert_close(spans[..., 1][mask], result.end_logits[mask], **close)
    assert fresh_heads(out) == {"ModernBertForMaskedLM": ["pooler"]}.get(
        kind, ["pooler", "mlm_head"] if kind == "ModernBertModel" else ["mlm_head"])


def test_mean_pooling_classifies_as_transformers_does(tokenizer_dir, tmp_path):
    hf = hf_checkpoint(tmp_path / "hf", "ModernBertForSequenceClassification", tokenizer_dir,
                       classifier_pooling="mean")
    ours = load_model(import_modernbert(tmp_path / "hf", tmp_path / "ours"))
    assert ours.config.classifier_pooling == "mean"
    ids, mask = padded(hf.config)
    with torch.no_grad():
        got = ours.classify_logits(ours.pool(ours(ids), ids))
    torch.testing.assert_close(got, hf_outputs(hf, ids, mask).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="pass the ids"):
        ours.pool(ours(ids))


def test_the_older_config_keys_and_the_newer_read_alike(tokenizer_dir, tmp_path):
    """ModernBERT's released config.json (global_attn_every_n_layers, global_rope_theta,
    local_rope_theta) and transformers 5's (layer_types, rope_parameters): one model,
    the same import, and every layer full or sliding as either says."""
    hf_checkpoint(tmp_path / "hf", "ModernBertModel", tokenizer_dir)
    file = tmp_path / "hf" / "config.json"
    written = json.loads(file.read_text())
    assert "layer_types" in written and "rope_parameters" in written
    older = {key: value for key, value in written.items()
             if key not in ("layer_types", "rope_parameters")}
    older |= {key: SIZES[key] for key in ("global_attn_every_n_layers", "global_rope_theta",
                                          "local_rope_theta")}
    newer = load_model(import_modernbert(tmp_path / "hf", tmp_path / "newer")).config
    file.write_text(json.dumps(older))
    assert load_model(import_modernbert(tmp_path / "hf", tmp_path / "older")).config == newer
    file.write_text(json.dumps({**older, "global_attn_every_n_layers": 2}))
    assert load_model(import_modernbert(tmp_path / "hf", tmp_path / "halves")
                      ).config.full_attention_layers == (0, 2)


def test_pairs_are_tokenized_and_classified_as_transformers_does(tokenizer_dir, tmp_path):
    """[CLS] A [SEP] B [SEP] by `SentenceEncoder.classify` in PyTorch and on the ONNX
    export (its sliding layers banded), against transformers on the fast tokenizer's
    encoding; rows longer than the window."""
    pytest.importorskip("onnxruntime")
    from transduce.decode.encode import SentenceEncoder
    from transduce.export.onnx import export_onnx

    hf = hf_checkpoint(tmp_path / "hf", "ModernBertForSequenceClassification", tokenizer_dir)
    out = import_modernbert(tmp_path / "hf", tmp_path / "ours")
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    first = ["hello world", "the quick brown fox jumps over the lazy dog, twice over"]
    second = ["the lazy dog and a stitch in time", "hello"]
    encoded = fast(first, second, padding=True, return_tensors="pt")
    assert encoded["input_ids"].shape[1] > 2 * SIZES["local_attention"]
    with torch.no_grad():
        expected = hf(**encoded).logits.softmax(-1)
    for path in (out, export_onnx(out, tmp_path / "onnx")):
        found = SentenceEncoder.load(path).classify(first, pairs=second)
        for prediction, probabilities in zip(found, expected):
            assert list(prediction.probabilities.values()) == pytest.approx(
                probabilities.tolist(), abs=1e-5)


def test_fine_tuning_the_import_gives_transformers_loss(tokenizer_dir, tmp_path):
    hf = hf_checkpoint(tmp_path / "hf", "ModernBertForSequenceClassification", tokenizer_dir)
    out = import_modernbert(tmp_path / "hf", tmp_path / "ours")
    labelled = [("positive", "hello world, hello there"), ("negative", "all that glitters"),
                ("neutral", "the quick brown fox jumps over the lazy dog and runs on")]
    assert_a_classification_batch_gives_transformers_loss(hf.train(), out, labelled,
                                                          tmp_path, hf.config.pad_token_id)


@pytest.mark.parametrize("kind", ["ModernBertForSequenceClassification",
                                  "ModernBertForMaskedLM", "ModernBertForQuestionAnswering"])
def test_export_hf_is_modernbert_again(kind, tokenizer_dir, tmp_path, capsys):
    hf = hf_checkpoint(tmp_path / "hf", kind, tokenizer_dir)
    out = import_modernbert(tmp_path / "hf", tmp_path / "ours")
    assert main(["export", "hf", str(out), str(tmp_path / "back")]) == 0
    assert f"({kind}: load it with" in capsys.readouterr().out
    back = getattr(transformers, kind).from_pretrained(tmp_path / "back").eval()
    theirs = back.state_dict()
    assert sorted(theirs) == sorted(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    ids, mask = padded(hf.config)
    expected, got = hf_outputs(hf, ids, mask), hf_outputs(back, ids, mask)
    torch.testing.assert_close(got.hidden_states[-1], expected.hidden_states[-1])
    assert back.config.layer_types == hf.config.layer_types
    assert back.config.rope_parameters == hf.config.rope_parameters
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert fast("hello world", "the dog")["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))(
            "hello world", "the dog")["input_ids"]


@pytest.mark.parametrize("changes, message", [
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                             "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     r"rope_parameters\['full_attention'\] rope_type='linear' is not supported"),
    ({"attention_bias": True}, r"ours has biases in all three or in none"),
    ({"hidden_activation": "quick_gelu"}, r"hidden_activation='quick_gelu' is not supported"),
    ({"architectures": ["ModernBertForMultipleChoice"]}, r"a multiple-choice model"),
    ({"layer_types": ["full_attention"]}, r"layer_types must list 4 of"),
    ({"pad_token_id": 1}, r"pad_token_id=1 but the tokenizer's pad token '\[PAD\]'"),
    ({"vocab_size": 100}, r"vocab_size=100 is smaller than the tokenizer's"),
])
def test_what_ours_cannot_hold_is_refused_by_name(changes, message, tokenizer_dir, tmp_path,
                                                  capsys):
    hf_checkpoint(tmp_path / "hf", "ModernBertModel", tokenizer_dir)
    file = tmp_path / "hf" / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))
    with pytest.raises(ForeignCheckpointError, match=message):
        import_modernbert(tmp_path / "hf", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()
    assert main(["import", "hf-modernbert", str(tmp_path / "hf"), "--out",
                 str(tmp_path / "ours")]) != 0
    assert "config.json" in capsys.readouterr().err


def test_a_masked_lm_whose_head_computes_another_activation_is_refused(tokenizer_dir,
                                                                      tmp_path):
    hf_checkpoint(tmp_path / "hf", "ModernBertForMaskedLM", tokenizer_dir,
                  classifier_activation="relu")
    with pytest.raises(ForeignCheckpointError, match=r"classifier_activation='relu' differs "
                                                     r"from hidden_activation='gelu'"):
        import_modernbert(tmp_path / "hf", tmp_path / "ours")


def test_export_ct2_is_refused_by_name(tokenizer_dir, tmp_path):
    from transduce.export import export_ctranslate2
    from transduce.export.common import ExportError

    hf_checkpoint(tmp_path / "hf", "ModernBertModel", tokenizer_dir)
    out = import_modernbert(tmp_path / "hf", tmp_path / "ours")
    with pytest.raises(ExportError, match=r"cannot export to CTranslate2: .*"
                                          r"prediction_head=True.*positional='rotary'"):
        export_ctranslate2(out, tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()


@pytest.mark.parametrize("every, kind", [(1, "softmax"), (10, "sliding")])
def test_all_full_and_all_but_one_sliding_layers_match_transformers(every, kind,
                                                                    tokenizer_dir, tmp_path):
    """One full layer in every layer (no sliding: softmax attention everywhere), or in
    ten (layer 0 alone full)."""
    hf = hf_checkpoint(tmp_path / "hf", "ModernBertModel", tokenizer_dir,
                       global_attn_every_n_layers=every)
    ours = load_model(import_modernbert(tmp_path / "hf", tmp_path / "ours"))
    assert ours.config.attention_type == kind
    assert ours.config.full_attention_layers == (() if every == 1 else (0,))
    ids, mask = padded(hf.config)
    with torch.no_grad():
        hidden = ours(ids)
    torch.testing.assert_close(hidden[mask], hf_outputs(hf, ids, mask).hidden_states[-1][mask],
                               atol=1e-5, rtol=1e-5)


def test_a_sentence_transformers_model_embeds_as_it_does(tokenizer_dir, tmp_path):
    """gte-modernbert's layout: a ModernBertModel under sentence-transformers' modules.json,
    [CLS] pooling and Normalize; `embed` gives transformers' [CLS] states, L2-normalised,
    of lines longer than the window, in PyTorch and through the ONNX export."""
    pytest.importorskip("onnxruntime")
    from transduce.decode.encode import SentenceEncoder
    from transduce.export.onnx import export_onnx

    hf = hf_checkpoint(tmp_path / "hf", "ModernBertModel", tokenizer_dir)
    modules = [{"idx": i, "name": str(i), "path": path,
                "type": f"sentence_transformers.models.{kind}"}
               for i, (path, kind) in enumerate([("", "Transformer"), ("1_Pooling", "Pooling"),
                                                 ("2_Normalize", "Normalize")])]
    (tmp_path / "hf" / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "hf" / "1_Pooling").mkdir()
    (tmp_path / "hf" / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True,
         "pooling_mode_mean_tokens": False}))
    out = import_modernbert(tmp_path / "hf", tmp_path / "ours")
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    lines = [" ".join(TEXT[i:i + 3]) for i in range(4)]
    encoded = fast(lines, padding=True, return_tensors="pt")
    assert encoded["input_ids"].shape[1] > 2 * SIZES["local_attention"]
    with torch.no_grad():
        expected = torch.nn.functional.normalize(hf(**encoded).last_hidden_state[:, 0], dim=-1)
    for path in (out, export_onnx(out, tmp_path / "onnx")):
        vectors = SentenceEncoder.load(path).embed(lines)
        np.testing.assert_allclose(vectors, expected.numpy(), atol=1e-5)
