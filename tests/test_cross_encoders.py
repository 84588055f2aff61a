"""Cross-encoders (a BERT or XLM-R with a head of one output: ms-marco-MiniLM,
bge-reranker) imported from transformers: score gives transformers' logits for pairs
as sentence-transformers' CrossEncoder reads them (cut "longest_first" to the model's
positions), rerank orders by them with their sigmoid as relevance, in PyTorch, through
the ONNX export and the export back to transformers, and on the command line; classify
is refused for one output, and score for a classifier."""

import numpy as np
import pytest
import torch

from tests.test_import_bert import CONFIGS as BERT_CONFIGS
from tests.test_import_bert import randomised as randomised_bert
from tests.test_import_bert import vocab  # noqa: F401 - a fixture
from tests.test_import_roberta import randomised as randomised_roberta
from tests.test_import_roberta import xlmr_vocab  # noqa: F401 - a fixture
from transduce.cli import main
from transduce.config import ConfigError
from transduce.decode.encode import SentenceEncoder
from transduce.errors import LineTruncated
from transduce.importers import import_bert, import_roberta

transformers = pytest.importorskip("transformers")

QUERY = "the quick brown fox"
DOCUMENTS = ["the lazy dog", "hello world!", "quick brown foxes jumped over the lazy dogs",
             "El niño comió café", "", "fox " * 80]          # the last is cut


def cross_encoder(directory, family, tokenizer_dir):
    """A random transformers model of one output, saved with its tokenizer."""
    torch.manual_seed(3)
    fast = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if family == "bert":
        config = transformers.BertConfig(vocab_size=len(fast), pad_token_id=0, num_labels=1,
                                         initializer_range=0.2, **BERT_CONFIGS[0])
        model = randomised_bert(transformers.BertForSequenceClassification(config).eval())
    else:
        config = transformers.XLMRobertaConfig(
            vocab_size=len(fast), pad_token_id=1, bos_token_id=0, eos_token_id=2,
            type_vocab_size=1, num_labels=1, initializer_range=0.2, num_hidden_layers=2,
            num_attention_heads=2, hidden_size=32, intermediate_size=48,
            max_position_embeddings=40)
        model = randomised_roberta(
            transformers.XLMRobertaForSequenceClassification(config).eval())
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return model, fast


@pytest.fixture(scope="module", params=["bert", "xlmr"])
def imported(request, vocab, xlmr_vocab, tmp_path_factory):  # noqa: F811 - fixtures
    """(transformers' model, its tokenizer, our import's path)."""
    root = tmp_path_factory.mktemp(request.param)
    tokenizer_dir = vocab / "uncased" / "json" if request.param == "bert" else xlmr_vocab
    hf, fast = cross_encoder(root / "hf", request.param, tokenizer_dir)
    importer = import_bert if request.param == "bert" else import_roberta
    return hf, fast, importer(root / "hf", root / "ours")


def their_logits(hf, fast, limit):
    """CrossEncoder.predict's logits: the pairs tokenized together, cut "longest_first"."""
    inputs = fast([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True, truncation=True,
                  max_length=limit, return_tensors="pt")
    with torch.no_grad():
        return hf(**inputs).logits[:, 0].numpy()


def test_scores_and_ranking_are_transformers(imported):
    hf, fast, out = imported
    encoder = SentenceEncoder.load(out)
    expected = their_logits(hf, fast, encoder.model.config.max_positions)
    assert encoder.scores and not encoder.classifies
    with pytest.warns(LineTruncated) as caught:
        scores = encoder.score([QUERY] * len(DOCUMENTS), pairs=DOCUMENTS, batch_tokens=90)
    assert "line 6" in [str(w.message).split(":")[0] for w in caught]    # (XLM-R's 3 too)
    np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0)
    ranked = encoder.rerank(QUERY, DOCUMENTS)                  # no warning: cut by design
    assert [r.index for r in ranked] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([r.relevance for r in ranked],
                               1 / (1 + np.exp(-np.sort(expected)[::-1])), atol=1e-6)
    assert [r.index for r in encoder.rerank(QUERY, DOCUMENTS, top_n=2)] == \
        [r.index for r in ranked[:2]]
    with pytest.raises(ConfigError, match="one output .* not classes: score or rerank"):
        encoder.classify(DOCUMENTS)


def test_the_exports_score_alike(imported, tmp_path):
    """ONNX Runtime on `export onnx`; transformers on `export hf`, a model of one label."""
    hf, fast, out = imported
    assert main(["export", "onnx", str(out), str(tmp_path / "onnx")]) == 0
    exported = SentenceEncoder.load(tmp_path / "onnx")
    expected = their_logits(hf, fast, exported.model.config.max_positions)
    np.testing.assert_allclose(exported.score([QUERY] * len(DOCUMENTS), pairs=DOCUMENTS,
                                              warn=False), expected, atol=1e-5, rtol=0)
    assert main(["export", "hf", str(out), str(tmp_path / "hf")]) == 0
    again = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path / "hf")).eval()
    assert again.config.num_labels == 1
    np.testing.assert_allclose(their_logits(again, fast, exported.model.config.max_positions),
                               expected, atol=1e-5, rtol=0)


def test_the_command_line_scores_and_reranks(imported, tmp_path, capsys):
    hf, fast, out = imported
    expected = their_logits(hf, fast, SentenceEncoder.load(out).model.config.max_positions)
    (tmp_path / "pairs.txt").write_text("".join(f"{QUERY}\t{d}\n" for d in DOCUMENTS))
    assert main(["score", "--model", str(out), "--pairs", "--input",
                 str(tmp_path / "pairs.txt")]) == 0
    printed = capsys.readouterr()
    np.testing.assert_allclose([float(x) for x in printed.out.split()], expected, atol=1e-5)
    assert "line 6:" in printed.err                          # the cut pair, named
    (tmp_path / "documents.txt").write_text("".join(d + "\n" for d in DOCUMENTS))
    assert main(["rerank", "--model", str(out), "--query", QUERY, "--top", "3", "--input",
                 str(tmp_path / "documents.txt")]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    order = np.argsort(-expected, kind="stable")[:3]
    assert [int(row[0]) for row in rows] == [i + 1 for i in order]       # line numbers
    assert [row[2] for row in rows] == [DOCUMENTS[i] for i in order]
    assert main(["classify", "--model", str(out), "--input",
                 str(tmp_path / "documents.txt")]) == 2
    assert "transduce score" in capsys.readouterr().err


def test_a_classifier_is_no_scorer_and_the_top_n_must_count(vocab, tmp_path):  # noqa: F811
    from tests.test_import_bert import hf_checkpoint

    hf_checkpoint(tmp_path / "hf", "BertForSequenceClassification", vocab / "uncased" / "json",
                  **BERT_CONFIGS[0])
    classifier = SentenceEncoder.load(import_bert(tmp_path / "hf", tmp_path / "ours"))
    with pytest.raises(ConfigError, match="one output .* this one has 3 classes: classify"):
        classifier.score(["a"])
    with pytest.raises(ConfigError, match="one output .* this one has 3 classes"):
        classifier.rerank("a", ["b"])
    hf_checkpoint(tmp_path / "hf-base", "BertModel", vocab / "uncased" / "json",
                  **BERT_CONFIGS[0])
    plain = SentenceEncoder.load(import_bert(tmp_path / "hf-base", tmp_path / "base"))
    with pytest.raises(ConfigError, match="this one has no head"):
        plain.rerank("a", ["b"])
