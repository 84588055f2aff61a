"""The encoder-only model (BERT) on the encoder's layers: sizes, padding, segments, heads.
(Parity with transformers' BERT is in tests/test_import_bert.py.)"""

import pytest
import torch

from transduce.config import preset
from transduce.model import EncoderOnly, build_model

VOCAB = 50


def tiny(**changes) -> EncoderOnly:
    return build_model(preset("bert-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                              **changes)).eval()


def test_bert_base_has_the_papers_size():
    with torch.device("meta"):
        model = build_model(preset("bert-base"))
    # BertForPreTraining's count: embeddings, 12 layers, pooler, MLM and NSP heads.
    assert model.num_parameters() == 110_106_428
    assert model.mlm_head.decoder.weight is model.embed.embedding.weight


def test_right_padding_changes_nothing_before_it():
    model = tiny()
    ids = torch.randint(4, VOCAB, (1, 7))
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded)[:, :7], model(ids), atol=1e-5, rtol=0)
        torch.testing.assert_close(model.sentence_embeddings(padded),
                                   model.sentence_embeddings(ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("positional", ["learned", "sinusoidal", "fairseq", "rotary", "t5"])
def test_every_kind_of_position_tells_the_order(positional):
    """A table of any kind is added to the embeddings, as in the encoder-decoder (a
    sinusoidal encoder-only model had no positions at all before)."""
    model = tiny(positional=positional)
    ids = torch.randint(4, VOCAB, (1, 6))
    with torch.no_grad():
        hidden, swapped = model(ids), model(ids.flip(1)).flip(1)
    assert not torch.allclose(hidden, swapped, atol=1e-4)


def test_segments_enter_the_embedding():
    model = tiny()
    ids = torch.randint(4, VOCAB, (2, 6))
    segments = torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)
    with torch.no_grad():
        assert not torch.allclose(model(ids, segments), model(ids))
        torch.testing.assert_close(model(ids, torch.zeros_like(ids)), model(ids))


def test_heads_have_their_shapes_and_the_classifier_is_optional():
    model = tiny(num_labels=3)
    ids = torch.randint(4, VOCAB, (2, 6))
    with torch.no_grad():
        hidden = model(ids)
        pooled = model.pool(hidden)
        assert model.mlm_logits(hidden).shape == (2, 6, VOCAB)
        assert model.nsp_logits(pooled).shape == (2, 2)
        assert model.classify_logits(pooled).shape == (2, 3)
    with pytest.raises(ValueError, match="no classification head"):
        tiny().classify_logits(pooled)
    assert model.attention_modules().keys() == {"encoder"}
    assert not any(key.startswith("embed.") for key in model.state_dict())   # stored once
