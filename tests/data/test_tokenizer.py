import numpy as np
import pytest

from transduce.data.tokenizer import (BOS_ID, EOS_ID, PAD_ID, THREADED_FROM, UNK_ID,
                                      Tokenizer, TokenizerError, train_tokenizer)

SENTENCES = [
    "En el principio crió Dios los cielos y la tierra.",
    "In the beginning God created the heaven and the earth.",
    "Y dijo Dios: Sea la luz: y fué la luz.",
    "And God said, Let there be light: and there was light.",
    "¿Qué más tiene el sabio que el necio?  Dos espacios.",
    "What hath the wise more than the fool? “Quoted” — dash.",
] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(SENTENCES, tmp_path_factory.mktemp("vocab"), vocab_size=400)


def test_special_ids_are_fixed(tokenizer):
    p = tokenizer.processor
    assert (p.pad_id(), p.bos_id(), p.eos_id(), p.unk_id()) == (PAD_ID, BOS_ID, EOS_ID, UNK_ID)
    assert tokenizer.vocab_size == 400


def test_round_trip_is_lossless_even_for_unseen_characters(tokenizer):
    texts = SENTENCES[:6] + ["Ωμέγα 漢字 ñandú  spaced  out", " leading and trailing "]
    for text, ids in zip(texts, tokenizer.encode(texts)):
        assert tokenizer.decode(ids) == text
        assert UNK_ID not in ids


def test_few_texts_one_by_one_and_many_on_threads_encode_alike(tokenizer):
    texts = [f"{sentence} {i}" for i, sentence in enumerate(SENTENCES)][:THREADED_FROM + 5]
    many = tokenizer.encode(texts)                        # SentencePiece's threaded batch
    few = [ids for start in range(0, len(texts), 3)
           for ids in tokenizer.encode(texts[start:start + 3])]     # one by one
    assert many == few == [tokenizer.processor.encode(t, out_type=int) for t in texts]
    assert tokenizer.encode([]) == []
    assert tokenizer.encode(("la luz",)) == [tokenizer.processor.encode("la luz", out_type=int)]


def test_decode_stops_at_eos_and_skips_pad_and_bos(tokenizer):
    ids = tokenizer.encode(["la luz"])[0]
    assert tokenizer.decode([BOS_ID, *ids, EOS_ID, *ids, PAD_ID]) == "la luz"


def test_encoding_is_cached_on_disk(tokenizer, tmp_path, monkeypatch):
    first = tokenizer.encode_cached(SENTENCES, tmp_path)
    assert len(list(tmp_path.glob("*.npz"))) == 1
    monkeypatch.setattr(tokenizer, "encode", lambda texts: pytest.fail("re-tokenised"))
    second = tokenizer.encode_cached(SENTENCES, tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    assert [list(a) for a in second] == tokenizer.processor.encode(SENTENCES, out_type=int)


def test_missing_model_and_impossible_vocab_are_clear(tmp_path):
    with pytest.raises(TokenizerError, match="transduce vocab"):
        Tokenizer(tmp_path / "spm.model")
    with pytest.raises(TokenizerError, match="could not train a 100000-token vocabulary"):
        train_tokenizer(SENTENCES, tmp_path, vocab_size=100000)
