"""Tiny untrained models of the three kinds (and a cross-encoder), saved with the toy
corpus's tokenizer, and in-process apps serving them (TestClient runs the app's
lifespan, so the decoding worker starts and stops with each client)."""

import pytest
import torch
from fastapi.testclient import TestClient

from transduce import checkpoint, load
from transduce.config import preset
from transduce.data.tokenizer import MODEL_NAME
from transduce.model import Transformer, build_model
from transduce.serve import Limits, create_app

LABELS = ["animals", "numbers", "things"]
TAGS = ["O", "B-ANIMAL", "I-ANIMAL", "B-NUMBER"]
SENTENCES = ["uno dos tres casa", "el perro", "gato rojo grande come el perro", "casa",
             "tres tres dos uno el gato come", "perro grande", "el gato rojo", "dos"]


@pytest.fixture(scope="session")
def translation_dir(tiny_corpus, tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=300, tgt_vocab_size=300, max_positions=40))
    path = tmp_path_factory.mktemp("serve-mt") / "model"
    checkpoint.save(path, model, None, tiny_corpus / MODEL_NAME)
    return path


@pytest.fixture(scope="session")
def lm_dir(tiny_corpus, tmp_path_factory):
    torch.manual_seed(0)
    model = build_model(preset("gpt-tiny", src_vocab_size=300, tgt_vocab_size=300,
                               max_positions=64))
    path = tmp_path_factory.mktemp("serve-lm") / "model"
    checkpoint.save(path, model, None, tiny_corpus / MODEL_NAME)
    return path


@pytest.fixture(scope="session")
def encoder_dir(tiny_corpus, tmp_path_factory):
    torch.manual_seed(0)
    model = build_model(preset("bert-tiny", src_vocab_size=300, tgt_vocab_size=300,
                               num_labels=len(LABELS), max_positions=32))
    model.labels = LABELS
    path = tmp_path_factory.mktemp("serve-bert") / "model"
    checkpoint.save(path, model, None, tiny_corpus / MODEL_NAME)
    return path


@pytest.fixture(scope="session")
def reranker(tiny_corpus, tmp_path_factory):
    """An encoder whose head has one output, as a cross-encoder's, loaded as served."""
    torch.manual_seed(1)
    model = build_model(preset("bert-tiny", src_vocab_size=300, tgt_vocab_size=300,
                               num_labels=1, max_positions=32))
    path = tmp_path_factory.mktemp("serve-reranker") / "model"
    checkpoint.save(path, model, None, tiny_corpus / MODEL_NAME)
    return load(path)


@pytest.fixture(scope="session")
def tagger(tiny_corpus, tmp_path_factory):
    """A token classifier of 8 positions (a longer text is tagged in chunks), loaded."""
    torch.manual_seed(2)
    model = build_model(preset("bert-tiny", src_vocab_size=300, tgt_vocab_size=300,
                               num_labels=len(TAGS), token_classifier=True, max_positions=8))
    with torch.no_grad():
        model.classifier.bias.normal_(0.0, 1.0)
    model.labels = TAGS
    path = tmp_path_factory.mktemp("serve-tagger") / "model"
    checkpoint.save(path, model, None, tiny_corpus / MODEL_NAME)
    return load(path)


@pytest.fixture(scope="session")
def answerer(tiny_corpus, tmp_path_factory):
    """A question answerer of 16 positions (a longer context is read in windows),
    loaded."""
    torch.manual_seed(3)
    model = build_model(preset("bert-tiny", src_vocab_size=300, tgt_vocab_size=300,
                               num_labels=2, question_answering=True, max_positions=16))
    model.labels = ["start", "end"]
    path = tmp_path_factory.mktemp("serve-answerer") / "model"
    checkpoint.save(path, model, None, tiny_corpus / MODEL_NAME)
    return load(path)


@pytest.fixture(scope="session")
def translator(translation_dir):
    return load(translation_dir)


@pytest.fixture(scope="session")
def generator(lm_dir):
    return load(lm_dir)


@pytest.fixture(scope="session")
def encoder(encoder_dir):
    return load(encoder_dir)


@pytest.fixture(scope="session")
def chatml(tmp_path_factory):
    """A random ChatML instruct Llama saved by transformers and imported
    (tests/chat_models.py), with an end token besides eos."""
    from tests.chat_models import chatml_model

    return chatml_model(tmp_path_factory.mktemp("chatml"))


def client_for(model, **limits) -> TestClient:
    return TestClient(create_app(model, name="tiny", limits=Limits(**limits)),
                      raise_server_exceptions=False)


@pytest.fixture()
def mt(translator):
    with client_for(translator, max_chars=200, max_texts=16, max_queue=64) as client:
        yield client


@pytest.fixture()
def lm(generator):
    with client_for(generator, max_chars=200, max_texts=16) as client:
        yield client


@pytest.fixture()
def enc(encoder):
    with client_for(encoder, max_chars=200, max_texts=16) as client:
        yield client


@pytest.fixture()
def tags(tagger):
    with client_for(tagger, max_chars=200, max_texts=16) as client:
        yield client


@pytest.fixture()
def asks(answerer):
    with client_for(answerer, max_chars=200, max_texts=16) as client:
        yield client


@pytest.fixture()
def ranks(reranker):
    with client_for(reranker, max_chars=200, max_texts=16) as client:
        yield client
