"""Token classification: imported *ForTokenClassification models (BERT, RoBERTa,
DistilBERT) tag each word as transformers' model does at the word's first piece, long
lines in chunks of whole words, through PyTorch and ONNX Runtime; `export hf` writes
them back; `transduce tag` and `evaluate`; BIO entities and conlleval's scores; and the
tagging corpus's reader, pieces and batches."""

import numpy as np
import pytest
import torch

from transduce.cli import main
from transduce.config import ConfigError
from transduce.data.corpus import CorpusError, corpus_kind
from transduce.data.masking import IGNORE
from transduce.data.tagged import read_tagged, sentence_pieces, word_pieces
from transduce.decode.encode import SentenceEncoder
from transduce.decode.tagging import chunks, entities, entity_scores, tag_items
from transduce.model import load_model
from tests.encoder_heads import CLASSES, IMPORTERS, imported_head
from tests.test_import_bert import VOCAB, vocab  # noqa: F401 - vocab: a fixture
from tests.test_import_roberta import roberta_vocab  # noqa: F401 - a fixture

transformers = pytest.importorskip("transformers")

TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
LINES = ["the quick brown fox jump over the lazy dog", "hello world", "",
         "the dog want the cafe and the fox run over the lazy world the end",
         "  the   fox  "]
FAMILIES = list(IMPORTERS)


@pytest.fixture(scope="module", params=FAMILIES)
def imported(request, vocab, roberta_vocab, tmp_path_factory):  # noqa: F811
    """(family, transformers' token classifier, its tokenizer, our import's path): 12
    positions, so that long lines are tagged in chunks."""
    family = request.param
    tokenizer_dir = roberta_vocab / "json" if family == "roberta" else vocab / "uncased" / "json"
    hf, fast, out = imported_head(family, "TokenClassification",
                                  tmp_path_factory.mktemp(f"tagger-{family}"), tokenizer_dir,
                                  12, id2label=dict(enumerate(TAGS)),
                                  label2id={tag: i for i, tag in enumerate(TAGS)})
    return family, hf, fast, out


def expected_tags(hf, fast, words, after_a_space=False):
    """transformers' tag of each word: its logits at the word's first token of the
    whole text, as the tokenizer splits it (after_a_space: a text that went on from
    another, as its first word's pieces are in the whole line: byte-level BPE keeps
    the space)."""
    encoded = fast(" " * after_a_space + " ".join(words), return_tensors="pt")
    inputs = {name: encoded[name] for name in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = hf(**inputs).logits[0]                                        # (T, K)
    word_ids = encoded.word_ids()
    firsts = [word_ids.index(index) for index in range(len(words))]
    probabilities = logits.softmax(dim=-1)[firsts]
    return [TAGS[int(i)] for i in probabilities.argmax(-1)], probabilities.max(-1).values


def expected_line(hf, fast, tokenizer, line, room):
    """A line's tags, chunk by chunk as tag_items cuts it."""
    words = line.split()
    tags, probabilities = [], []
    for start, end in chunks(word_pieces(tokenizer, words), room):
        chunk_tags, chunk_probabilities = expected_tags(hf, fast, words[start:end], start > 0)
        tags += chunk_tags
        probabilities += chunk_probabilities.tolist()
    return tags, probabilities


def test_imported_token_classifiers_tag_as_transformers(imported, tmp_path):
    """Every word's tag and probability, long lines in chunks, in PyTorch and through
    the ONNX export (whose logits are each token's)."""
    pytest.importorskip("onnxruntime")
    from transduce.decode.onnx_encoder_engine import OnnxSentenceEncoder
    from transduce.export.onnx import export_onnx

    family, hf, fast, out = imported
    model = load_model(out)
    assert model.config.token_classifier and model.labels == TAGS
    tokenizer = SentenceEncoder.load(out).tokenizer
    room = model.config.max_positions - 2
    assert len(tag_items(tokenizer, [LINES[3].split()], model.config.max_positions)) > 1
    for engine in (model, OnnxSentenceEncoder(export_onnx(out, tmp_path / "onnx"))):
        encoder = SentenceEncoder(engine, tokenizer)
        for line, tagged in zip(LINES, encoder.tag(LINES, batch_tokens=24)):
            assert [t.word for t in tagged] == line.split()
            if not tagged:
                continue
            tags, probabilities = expected_line(hf, fast, tokenizer, line, room)
            assert [t.tag for t in tagged] == tags, (family, line)
            np.testing.assert_allclose([t.probability for t in tagged], probabilities,
                                       atol=1e-5)


def test_a_token_classifier_exports_to_transformers_and_back(imported, tmp_path, capsys):
    family, hf, fast, out = imported
    assert main(["export", "hf", str(out), str(tmp_path / "hf")]) == 0
    kind = f"{CLASSES[family]}ForTokenClassification"
    assert f"{kind}: load it with transformers.AutoModelForTokenClassification" in \
        capsys.readouterr().out
    theirs = transformers.AutoModelForTokenClassification.from_pretrained(
        tmp_path / "hf").eval()
    assert type(theirs).__name__ == kind and theirs.config.id2label == dict(enumerate(TAGS))
    ids = fast(LINES[1], return_tensors="pt")["input_ids"]          # within 10 positions
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, hf(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    back = load_model(IMPORTERS[family](tmp_path / "hf", tmp_path / "back"))
    assert back.config.token_classifier and back.labels == TAGS
    assert torch.equal(back.classifier.weight, load_model(out).classifier.weight)


def test_the_command_line_tags_and_classify_refuses(imported, tmp_path, capsys):
    family, hf, fast, out = imported
    (tmp_path / "in.txt").write_text("hello world\n\nthe dog\n", encoding="utf-8")
    tagged = SentenceEncoder.load(out).tag(["hello world", "", "the dog"])
    formats = {
        "conll": "".join("".join(f"{t.word}\t{t.tag}\t{t.probability:.4f}\n" for t in line)
                         + "\n" for line in tagged),
        "tags": "".join(" ".join(t.tag for t in line) + "\n" for line in tagged)}
    for name, text in formats.items():
        assert main(["tag", "--model", str(out), "--input", str(tmp_path / "in.txt"),
                     "--format", name]) == 0
        assert capsys.readouterr().out == text
    assert main(["tag", "--model", str(out), "--input", str(tmp_path / "in.txt"),
                 "--format", "entities"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert main(["classify", "--model", str(out), "--input", str(tmp_path / "in.txt")]) == 2
    assert "labels each token, not the text: tag with it" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="tag with it"):
        SentenceEncoder.load(out).classify(["x"])


def test_a_model_without_a_token_classifier_is_refused(tmp_path):
    from transduce import checkpoint
    from transduce.config import preset
    from transduce.data.hf_tokenizer import HFTokenizer
    from transduce.model import build_model

    model = build_model(preset("bert-tiny", src_vocab_size=len(VOCAB),
                               tgt_vocab_size=len(VOCAB), num_labels=3))
    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    tokenizer = HFTokenizer.from_wordpiece(tmp_path / "vocab.txt")
    path = checkpoint.save(tmp_path / "classifier", model, None, tokenizer)
    with pytest.raises(ConfigError, match="no token-classification head"):
        SentenceEncoder.load(path).tag(["the dog"])


@pytest.mark.parametrize("tags, spans", [
    (["B-PER", "I-PER", "O", "B-LOC"], [("PER", 0, 2), ("LOC", 3, 4)]),
    (["I-PER", "I-PER", "B-PER"], [("PER", 0, 2), ("PER", 2, 3)]),     # IOB1's start
    (["B-PER", "I-LOC", "I-LOC", "O"], [("PER", 0, 1), ("LOC", 1, 3)]),
    (["O", "O"], []),
    (["B-MISC"], [("MISC", 0, 1)]),
    (["NOUN", "VERB"], []),             # tags of no kind (parts of speech) mark none
])
def test_entities_are_bio_spans(tags, spans):
    words = [f"w{i}" for i in range(len(tags))]
    found = entities(words, tags)
    assert [(e.kind, e.start, e.end) for e in found] == spans
    assert [e.text for e in found] == [" ".join(words[a:b]) for _, a, b in spans]


def test_entity_scores_count_as_conlleval():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    guess = [["B-PER", "O", "O", "B-LOC"], ["B-ORG", "B-PER"]]
    scores = entity_scores(guess, gold)
    # right: LOC and ORG (PER's end is wrong); found 4, gold 3
    assert scores["precision"] == 2 / 4 and scores["recall"] == 2 / 3
    assert scores["f1"] == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    assert scores["entities"] == 3
    assert entity_scores([["O"]], [["B-PER"]])["f1"] == 0.0


def test_chunks_hold_whole_words_and_cut_a_word_too_long():
    assert chunks([[1, 2], [3], [4, 5, 6], [7]], 4) == [(0, 2), (2, 4)]
    assert chunks([[1] * 9, [2]], 4) == [(0, 1), (1, 2)]
    assert chunks([], 4) == []

    class Pieces:
        bos_id, eos_id, unk_id = 1, 2, 3

        def encode(self, texts):
            return [[10 + len(text.strip())] * len(text.strip()) for text in texts]

    items = tag_items(Pieces(), [["aaaaaa", "b"], []], max_positions=5)
    assert [(i.line, i.start, i.end) for i in items] == [(0, 0, 1), (0, 1, 2)]
    assert items[0].ids.tolist() == [1, 16, 16, 16, 2] and items[0].firsts.tolist() == [1]
    assert items[1].ids.tolist() == [1, 11, 2]


def test_the_reader_takes_conll_columns_and_names_bad_lines(tmp_path):
    path = tmp_path / "train.conll"
    path.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n\n"
                    "Peter\tB-PER\nBlackburn\tI-PER\n", encoding="utf-8")
    corpus = read_tagged(path)
    assert corpus.words == [["EU", "rejects"], ["Peter", "Blackburn"]]
    assert corpus.tags == [["B-ORG", "O"], ["B-PER", "I-PER"]]
    assert corpus.line_numbers == [3, 7]
    (tmp_path / "corpus.json").write_text('{"kind": "tagging"}')
    assert corpus_kind(tmp_path) == "tagging"
    path.write_text("EU B-ORG\nrejects\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"train.conll:2: one column \('rejects'\)"):
        read_tagged(path)
    path.write_text("-DOCSTART- -X- O\n\n", encoding="utf-8")
    with pytest.raises(CorpusError, match="no tagged sentence"):
        read_tagged(path)


def test_a_word_s_tag_goes_to_its_first_piece(vocab, tmp_path):  # noqa: F811
    """Pieces as transformers' tokenizer splits the text, the tag at each word's first
    piece (word_ids), IGNORE at the others; a tag outside the list is named."""
    fast = transformers.AutoTokenizer.from_pretrained(str(vocab / "uncased" / "json"))
    from transduce.importers.hf_bert import read_tokenizer

    ours = read_tokenizer(vocab / "uncased" / "json")
    path = tmp_path / "dev.conll"
    path.write_text("unwantable\tB-PER\nruns\tI-PER\nthe\tO\n\nfoxes\tB-LOC\n",
                    encoding="utf-8")
    corpus = read_tagged(path)
    ids, tags = sentence_pieces(ours, corpus, TAGS)
    for words, got_ids, got_tags, gold in zip(corpus.words, ids, tags, corpus.tags):
        encoded = fast(" ".join(words), add_special_tokens=False)
        assert got_ids.tolist() == encoded["input_ids"]
        word_ids = encoded.word_ids()
        wanted = [TAGS.index(gold[w]) if i == 0 or word_ids[i - 1] != w else IGNORE
                  for i, w in enumerate(word_ids)]
        assert got_tags.tolist() == wanted
    assert (tags[0] == IGNORE).any()
    with pytest.raises(CorpusError, match=r"dev.conll:5: tag 'B-LOC' is not one of the 3"):
        sentence_pieces(ours, corpus, TAGS[:3])


def test_the_batcher_puts_tags_at_pieces_and_counts_them():
    from transduce.data.batching import EncoderBatcher
    from transduce.data.masking import EncoderSpecials

    specials = EncoderSpecials(cls_id=2, sep_id=3, pad_id=0, mask_id=4, special=(0, 2, 3, 4))
    ids = [np.array([10, 11, 12], dtype=np.int32), np.array([13, 14, 15, 16, 17])]
    tags = [np.array([1, IGNORE, 2], dtype=np.int32), np.array([0, 1, IGNORE, 2, 3])]
    batcher = EncoderBatcher(ids, max_tokens=64, max_len=5, vocab_size=20, mask=False,
                             tags=tags, specials=specials, shuffle=False)
    batch = batcher.collate(np.array([0, 1]))
    assert batch.ids.tolist() == [[2, 10, 11, 12, 3], [2, 13, 14, 15, 3]]
    assert batch.labels.tolist() == [[IGNORE, 1, IGNORE, 2, IGNORE],
                                     [IGNORE, 0, 1, IGNORE, IGNORE]]
    assert batcher.scored_counts(np.array([0, 1])) == {"tag": 4}    # cropped: 2 + 2
