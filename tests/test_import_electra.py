"""`import hf-electra`: ElectraModel, ElectraForPreTraining (its discriminator head left
unread), ElectraForMaskedLM and ElectraForSequenceClassification compute what
transformers computes (hidden states of padded rows, masked-LM and class logits, the
classifier's GELU), pairs are classified as transformers classifies them through
PyTorch and ONNX Runtime, `export hf` writes an ELECTRA again, CTranslate2's pooled output
is ours; each with embeddings as wide as the layers (electra-base's) and narrower,
projected (ELECTRA-small's), which CTranslate2 refuses by name. Its token
classifiers and question answerers are tested with the other families' (test_tagging.py,
test_question_answering.py, train/test_answering.py)."""

import json

import pytest
import torch

from transduce.cli import main
from transduce.importers import fresh_heads, import_electra
from transduce.importers.hf_bert import dropped_heads
from transduce.model import load_model
from tests.test_import_bert import vocab  # noqa: F401 - a fixture
from tests.test_import_distilbert import LABELS, assert_ct2_states, padded, randomised

transformers = pytest.importorskip("transformers")

KINDS = ["ElectraModel", "ElectraForPreTraining", "ElectraForMaskedLM",
         "ElectraForSequenceClassification"]
SIZES = dict(hidden_size=32, embedding_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=48)


def hf_checkpoint(directory, kind, tokenizer_dir, **config):
    """A random transformers Electra* model saved with save_pretrained, with
    ElectraTokenizerFast's files."""
    fast = transformers.ElectraTokenizerFast.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    hf_config = transformers.ElectraConfig(vocab_size=len(fast), pad_token_id=0,
                                           initializer_range=0.2, **{**SIZES, **config})
    if kind.endswith("SequenceClassification"):
        hf_config.id2label, hf_config.label2id = LABELS, {v: k for k, v in LABELS.items()}
    model = randomised(getattr(transformers, kind)(hf_config).eval())
    model.save_pretrained(directory)
    fast.save_pretrained(str(directory))
    return model


# ELECTRA-small's embeddings are half as wide as its layers: 128 under 256.
WIDTHS = {"base": 32, "small": 16}


@pytest.fixture(scope="module", params=[(kind, width) for kind in KINDS for width in WIDTHS])
def imported(request, vocab, tmp_path_factory):  # noqa: F811
    """(kind, HF model, our model loaded from the imported checkpoint, checkpoint path)."""
    kind, width = request.param
    root = tmp_path_factory.mktemp("electra")
    hf = hf_checkpoint(root / "hf", kind, vocab / "uncased" / "txt",
                       embedding_size=WIDTHS[width])
    out = import_electra(root / "hf", root / "ours")
    return kind, hf, load_model(out), out


def test_outputs_match_transformers(imported):
    kind, hf, ours, out = imported
    assert ours.config.pooler_activation == "gelu" and ours.config.type_vocab_size == 2
    assert ours.config.embedding_width == hf.config.embedding_size
    assert (ours.embed.project is None) == (hf.config.embedding_size == 32)
    ids, mask = padded(hf.config)
    segments = (torch.arange(ids.shape[1]) > 4).long().expand_as(ids) * mask
    with torch.no_grad():
        result = hf(input_ids=ids, token_type_ids=segments, attention_mask=mask.long(),
                    output_hidden_states=True)
        hidden = ours(ids, segments, key_mask=mask)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[mask], result.hidden_states[-1][mask], **close)
    if kind == "ElectraForMaskedLM":
        torch.testing.assert_close(ours.mlm_logits(hidden)[mask], result.logits[mask], **close)
    if kind == "ElectraForSequenceClassification":
        torch.testing.assert_close(ours.classify_logits(ours.pool(hidden)), result.logits,
                                   **close)
        assert ours.labels == list(LABELS.values())
    assert dropped_heads(out) == (["discriminator_predictions"]
                                  if kind == "ElectraForPreTraining" else [])
    assert fresh_heads(out) == {"ElectraForMaskedLM": ["pooler"],
                                "ElectraForSequenceClassification": ["mlm_head"]}.get(
        kind, ["pooler", "mlm_head"])


@pytest.mark.parametrize("width", list(WIDTHS))
def test_pairs_are_classified_as_transformers_does_through_torch_and_onnx(width,
                                                                        vocab,  # noqa: F811
                                                                        tmp_path):
    """[CLS] A [SEP] B [SEP], B in segment 1, by `SentenceEncoder.classify` in PyTorch and
    on the ONNX export, against ElectraForSequenceClassification on the fast tokenizer's
    encoding."""
    pytest.importorskip("onnxruntime")
    from transduce.decode.encode import SentenceEncoder
    from transduce.export.onnx import export_onnx

    hf = hf_checkpoint(tmp_path / "hf", "ElectraForSequenceClassification",
                       vocab / "uncased" / "txt", embedding_size=WIDTHS[width])
    out = import_electra(tmp_path / "hf", tmp_path / "ours")
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    first, second = ["hello world", "the quick brown fox"], ["the lazy dog", "hello"]
    with torch.no_grad():
        expected = hf(**fast(first, second, padding=True, return_tensors="pt")).logits
    for path in (out, export_onnx(out, tmp_path / "onnx")):
        found = SentenceEncoder.load(path).classify(first, pairs=second)
        for prediction, logits in zip(found, expected.softmax(-1)):
            assert list(prediction.probabilities.values()) == pytest.approx(
                logits.tolist(), abs=1e-5)


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("kind", ["ElectraForSequenceClassification", "ElectraForMaskedLM"])
def test_export_hf_is_electra_again(kind, width, vocab, tmp_path, capsys):  # noqa: F811
    hf = hf_checkpoint(tmp_path / "hf", kind, vocab / "uncased" / "txt",
                       embedding_size=WIDTHS[width])
    out = import_electra(tmp_path / "hf", tmp_path / "ours")
    assert main(["export", "hf", str(out), str(tmp_path / "back")]) == 0
    assert f"({kind}: load it with" in capsys.readouterr().out
    back = getattr(transformers, kind).from_pretrained(tmp_path / "back").eval()
    ids, mask = padded(hf.config)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).logits
        got = back(input_ids=ids, attention_mask=mask.long()).logits
    torch.testing.assert_close(got[:, 0], expected[:, 0], atol=1e-5, rtol=1e-5)
    theirs = back.state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    settings = json.loads((tmp_path / "back" / "tokenizer_config.json").read_text())
    assert settings["model_input_names"] == ["input_ids", "token_type_ids", "attention_mask"]


def test_export_ct2_pools_with_gelu(vocab, tmp_path):  # noqa: F811
    """CTranslate2's encoder: transformers' hidden states, and our pooled output, GELU
    after the classifier's dense layer."""
    hf = hf_checkpoint(tmp_path / "hf", "ElectraForSequenceClassification",
                       vocab / "uncased" / "txt")
    out = import_electra(tmp_path / "hf", tmp_path / "ours")
    pooled, ct2_pooled = assert_ct2_states(hf, out, tmp_path)
    assert (pooled < 0).any()                # GELU's negatives, which ReLU would not give
    torch.testing.assert_close(ct2_pooled, pooled, atol=1e-5, rtol=1e-5)


def test_export_ct2_refuses_narrower_embeddings_by_name(vocab, tmp_path):  # noqa: F811
    from transduce.export import export_ctranslate2
    from transduce.export.common import ExportError

    hf_checkpoint(tmp_path / "hf", "ElectraForSequenceClassification",
                  vocab / "uncased" / "txt", embedding_size=16)
    out = import_electra(tmp_path / "hf", tmp_path / "ours")
    with pytest.raises(ExportError, match=r"embedding_size=16 \(the format embeds at "
                                          r"d_model=32\)"):
        export_ctranslate2(out, tmp_path / "ct2")
    assert not (tmp_path / "ct2").exists()
