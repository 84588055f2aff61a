"""Hugging Face RoBERTa, XLM-RoBERTa and CamemBERT -> our checkpoint: the imported
EncoderOnly computes what transformers' models compute (hidden states of padded rows,
whose positions count from pad + 1 there and from 0 here, the pooler, masked-LM and
classification logits, mean-pooled sentence embeddings), the tokenizers give
RobertaTokenizerFast's and XLMRobertaTokenizerFast's ids, the import fine-tunes with
<pad> at 1, and what cannot be reproduced is refused by name with nothing written."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from transduce import checkpoint
from transduce.cli import main
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.importers import fresh_heads, import_roberta
from transduce.importers.hf_roberta import read_tokenizer
from transduce.model import EncoderOnly, load_model
from tests.foreign_checkpoints import assert_a_classification_batch_gives_transformers_loss, \
    assert_refused, damaged

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEXT = ["In the beginning God created the heaven and the earth.",
        "And the earth was without form, and void; and darkness was upon the deep.",
        "And God said, Let there be light: and there was light.",
        "And God called the light Day, and the darkness he called Night.",
        "Ünïcödé, café, naïve; 中文 and emoji 🙂 too."] * 8
SAMPLES = ["Hello world!", "  leading and trailing spaces  ", "a <mask> in the middle",
           "<s> and </s> and <pad> as text", "café naïve 中文 🙂", "don't (stop) -- 3.14", ""]
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]


@pytest.fixture(scope="module")
def roberta_vocab(tmp_path_factory):
    """RoBERTa's byte-level BPE pair (vocab.json, merges.txt), <mask> last as in
    roberta-base, and as RobertaTokenizerFast saves it: {pair, json}/."""
    root = tmp_path_factory.mktemp("roberta-vocab")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT, vocab_size=400, special_tokens=SPECIALS, show_progress=False)
    vocabulary = bpe.get_vocab()
    bpe.add_tokens(["<mask>"])     # at the end of vocab.json, as in roberta-base's
    vocabulary["<mask>"] = len(vocabulary)
    (root / "pair").mkdir()
    bpe.save_model(str(root / "pair"))
    (root / "pair" / "vocab.json").write_text(json.dumps(vocabulary), encoding="utf-8")
    fast = roberta_tokenizer_fast(root / "pair")
    fast.save_pretrained(str(root / "json"))
    return root


def roberta_tokenizer_fast(directory):
    """RobertaTokenizerFast with roberta-base's <mask>, which takes the space before it
    (lstrip: its tokenizer.json's, and fairseq's masking of whole words with their
    space); transformers 5 builds it without, from the pair of files alone."""
    mask = tokenizers.AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False,
                                 special=True)
    return transformers.RobertaTokenizerFast.from_pretrained(str(directory), mask_token=mask)


@pytest.fixture(scope="module")
def xlmr_vocab(tmp_path_factory):
    """XLM-R's: a SentencePiece unigram model behind fairseq's four specials, as
    XLMRobertaTokenizerFast saves it (tokenizer.json)."""
    import sentencepiece

    root = tmp_path_factory.mktemp("xlmr-vocab")
    (root / "text.txt").write_text("\n".join(TEXT) + "\n", encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(root / "text.txt"), model_prefix=str(root / "spm"), vocab_size=120,
        model_type="unigram", hard_vocab_limit=False, minloglevel=2)
    (root / "spm").mkdir()
    shutil.copy(root / "spm.model", root / "spm" / "sentencepiece.bpe.model")
    fast = transformers.XLMRobertaTokenizerFast.from_pretrained(str(root / "spm"))
    fast.save_pretrained(str(root / "json"))
    return root / "json"


def randomised(model):
    """Biases and LayerNorm gains away from 0 and 1, so that a swapped mapping fails."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name:
                parameter.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.05)
    return model


KINDS = {"RobertaModel": "roberta", "RobertaForMaskedLM": "roberta",
         "RobertaForSequenceClassification": "roberta", "XLMRobertaForMaskedLM": "xlmr",
         "XLMRobertaForSequenceClassification": "xlmr", "CamembertModel": "xlmr"}
CONFIGS = [dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                intermediate_size=48, max_position_embeddings=40, hidden_act="gelu"),
           dict(num_hidden_layers=1, num_attention_heads=4, hidden_size=48,
                intermediate_size=40, max_position_embeddings=24, hidden_act="gelu_new",
                layer_norm_eps=1e-6, seed=1)]


def hf_checkpoint(directory, kind, tokenizer_dir, seed=0, **config):
    """A random transformers model of `kind` saved with save_pretrained, with a
    tokenizer."""
    fast = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir)) \
        if (tokenizer_dir / "tokenizer.json").is_file() else roberta_tokenizer_fast(tokenizer_dir)
    torch.manual_seed(seed)
    config_class = transformers.XLMRobertaConfig if "XLM" in kind else \
        transformers.CamembertConfig if "Camembert" in kind else transformers.RobertaConfig
    hf_config = config_class(vocab_size=len(fast), pad_token_id=1, bos_token_id=0,
                             eos_token_id=2, type_vocab_size=1, initializer_range=0.2,
                             **config)
    if "Classification" in kind:
        hf_config.id2label = {0: "negative", 1: "positive"}
        hf_config.label2id = {"negative": 0, "positive": 1}
    model = randomised(getattr(transformers, kind)(hf_config).eval())
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return model


CASES = [(index, kind) for index in range(len(CONFIGS)) for kind in KINDS
         if CONFIGS[index]["hidden_act"] == "gelu" or "MaskedLM" not in kind]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: f"config{case[0]}-{case[1]}")
def imported(request, roberta_vocab, xlmr_vocab, tmp_path_factory):
    """(kind, HF model, our model loaded from the imported checkpoint, its path)."""
    index, kind = request.param
    root = tmp_path_factory.mktemp("hf")
    vocab = roberta_vocab / "json" if KINDS[kind] == "roberta" else xlmr_vocab
    hf = hf_checkpoint(root / "hf", kind, vocab, **dict(CONFIGS[index]))
    out = import_roberta(root / "hf", root / "ours")
    return kind, hf, load_model(out), out


def padded_batch(out, hf_config):
    """Right-padded rows <s> text </s> of our tokenizer, the longest filling the
    positions, and the mask of real tokens."""
    tokenizer = checkpoint.load_tokenizer(out)
    words = " ".join(TEXT).split()
    room = hf_config.max_position_embeddings - 2 - 2
    texts = [" ".join(words[:60]), "And God said", "x"]
    rows = [[tokenizer.bos_id, *ids[:room], tokenizer.eos_id] for ids in tokenizer.encode(texts)]
    width = max(map(len, rows))
    assert width == room + 2       # the last position of the table is read
    ids = torch.full((len(rows), width), tokenizer.pad_id)
    for row, values in enumerate(rows):
        ids[row, :len(values)] = torch.tensor(values)
    return ids, ids != tokenizer.pad_id


def test_outputs_match_transformers(imported):
    kind, hf, ours, out = imported
    assert isinstance(ours, EncoderOnly) and not ours.training
    assert ours.config.pad_id == 1 and ours.config.type_vocab_size == 1
    assert ours.config.max_positions == hf.config.max_position_embeddings - 2
    ids, mask = padded_batch(out, hf.config)
    with torch.no_grad():
        result = hf(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
        hidden = ours(ids)
        pooled = ours.pool(hidden)
        embeddings = ours.sentence_embeddings(ids)
    close = dict(atol=1e-5, rtol=1e-5)
    expected_hidden = result.hidden_states[-1]
    torch.testing.assert_close(hidden[mask], expected_hidden[mask], **close)
    real = mask.unsqueeze(-1).float()     # sentence-transformers' mean pooling
    torch.testing.assert_close(embeddings, (expected_hidden * real).sum(1) / real.sum(1),
                               **close)
    if kind.endswith("Model"):
        torch.testing.assert_close(pooled, result.pooler_output, **close)
    if kind.endswith("MaskedLM"):
        torch.testing.assert_close(ours.mlm_logits(hidden)[mask], result.logits[mask], **close)
    if kind.endswith("Classification"):
        torch.testing.assert_close(ours.classify_logits(pooled), result.logits, **close)
        assert ours.labels == ["negative", "positive"] and ours.config.num_labels == 2
    else:
        assert ours.classifier is None and ours.labels is None
    expected_fresh = ["mlm_head"] if kind.endswith(("Model", "Classification")) else ["pooler"]
    assert fresh_heads(out) == expected_fresh
    assert torch.equal(ours.mlm_head.decoder.weight, ours.embed.embedding.weight)


@pytest.mark.parametrize("source", ["pair", "json"])
def test_roberta_tokenizer_ids_match_roberta_tokenizer_fast(roberta_vocab, source):
    directory = roberta_vocab / source
    fast = roberta_tokenizer_fast(directory)
    ours = read_tokenizer(directory)
    mask = fast.mask_token_id
    assert ours.encode(["a <mask> b"])[0][:2] == [fast.convert_tokens_to_ids("a"), mask]
    for text in SAMPLES + TEXT[:5]:
        assert [ours.bos_id, *ours.encode([text])[0], ours.eos_id] == fast(text)["input_ids"], \
            text
    assert ours.specials == {"bos_id": 0, "eos_id": 2, "pad_id": 1,
                             "mask_id": fast.mask_token_id}
    # <unk> as the model of the pair names it (byte-level BPE never needs it);
    # transformers' tokenizer.json names none.
    assert (ours.unk_id, ours.prepend_bos) == (3 if source == "pair" else None, True)
    assert set(ours.special_ids) == {0, 1, 2, 3, fast.mask_token_id}
    ids = ours.encode(["In the beginning"])[0]
    assert ours.decode([0, *ids, 2, 1, 1]) == fast.decode(ids) == "In the beginning"
    pair = ours.backend.encode("A", "B").ids       # the template a saved checkpoint keeps
    assert pair == fast("A", "B")["input_ids"]


def test_xlmr_tokenizer_ids_match_xlm_roberta_tokenizer_fast(xlmr_vocab):
    fast = transformers.XLMRobertaTokenizerFast.from_pretrained(str(xlmr_vocab))
    ours = read_tokenizer(xlmr_vocab)
    for text in SAMPLES + TEXT[:5]:
        assert [ours.bos_id, *ours.encode([text])[0], ours.eos_id] == fast(text)["input_ids"], \
            text
    assert ours.specials == {"bos_id": 0, "eos_id": 2, "pad_id": 1,
                             "mask_id": fast.mask_token_id}
    assert ours.mask_id == len(fast) - 1 and ours.unk_id == 3


@pytest.fixture(scope="module")
def small_hf(roberta_vocab, tmp_path_factory):
    directory = tmp_path_factory.mktemp("small") / "hf"
    hf_checkpoint(directory, "RobertaForMaskedLM", roberta_vocab / "pair", **CONFIGS[0])
    return directory


def refused(directory, tmp_path, *messages):
    assert_refused(import_roberta, directory, tmp_path, *messages)


def test_prefixless_names_pytorch_model_bin_and_a_stored_decoder(small_hf, tmp_path):
    """RobertaModel's names (no "roberta." prefix), the position_ids buffer, the tied
    decoder stored, both names of its bias, in a pytorch_model.bin: the same import."""
    directory = damaged(small_hf, tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    renamed = {key.removeprefix("roberta."): tensor for key, tensor in tensors.items()}
    renamed["embeddings.position_ids"] = torch.arange(40)[None]
    renamed["lm_head.decoder.weight"] = renamed["embeddings.word_embeddings.weight"]
    bias = renamed.get("lm_head.bias", renamed.get("lm_head.decoder.bias"))
    renamed["lm_head.bias"] = renamed["lm_head.decoder.bias"] = bias.clone()
    (directory / "model.safetensors").unlink()
    torch.save(renamed, directory / "pytorch_model.bin")
    out = import_roberta(directory, tmp_path / "out")
    reference = import_roberta(small_hf, tmp_path / "reference")
    for (name, a), (_, b) in zip(load_model(out).state_dict().items(),
                                 load_model(reference).state_dict().items()):
        assert name.startswith(("pooler.", "nsp_head.")) or torch.equal(a, b), name  # fresh


@pytest.mark.parametrize("change,messages", [
    (dict(model_type="bert"), ["model_type='bert'", "'roberta' or 'xlm-roberta'"]),
    (dict(position_embedding_type="relative_key"), ['position_embedding_type="relative_key"']),
    (dict(is_decoder=True), ["is_decoder=true"]),
    (dict(hidden_act="silu"), ["hidden_act='silu'"]),
    (dict(hidden_act="gelu_new"), ["masked-LM head (lm_head.*)",
                                   "'gelu' whatever hidden_act says"]),
    (dict(pad_token_id=0), ["pad_token_id=0 but the tokenizer's pad token '<pad>' is 1"]),
    (dict(intermediate_size=20), ["'encoder.layer.0.intermediate.dense.weight' has shape "
                                  "(48, 32), the configuration needs (20, 32)"]),
])
def test_refuses_what_it_cannot_reproduce(small_hf, tmp_path, change, messages):
    refused(damaged(small_hf, tmp_path, config=lambda c: c.update(change)), tmp_path,
            "model.safetensors" if {"intermediate_size", "hidden_act"} & set(change) and
            change.get("hidden_act") != "silu" else "config.json",
            *messages)


def test_refuses_bad_weights(small_hf, tmp_path):
    def untie(tensors):
        tensors["lm_head.decoder.weight"] = tensors["roberta.embeddings.word_embeddings.weight"] + 1

    def two_poolers(tensors):
        for kind in ("weight", "bias"):
            tensors[f"roberta.pooler.dense.{kind}"] = tensors[f"lm_head.dense.{kind}"].clone()
            tensors[f"classifier.dense.{kind}"] = tensors[f"lm_head.dense.{kind}"].clone()

    def partial_head(tensors):
        del tensors["lm_head.layer_norm.bias"]

    def unknown(tensors):
        tensors["roberta.encoder.layer.0.attention.self.distance_embedding.weight"] = \
            torch.zeros(3)
    for change, messages in ((untie, ["'lm_head.decoder.weight' differs", "tied"]),
                             (two_poolers, ["two poolers", "'pooler.dense'",
                                            "'classifier.dense'"]),
                             (partial_head, ["missing weight 'lm_head.layer_norm.bias'"]),
                             (unknown, ["unknown weight 'roberta.encoder.layer.0.attention"])):
        case = tmp_path / change.__name__
        case.mkdir()
        refused(damaged(small_hf, case, weights=change), case, *messages)


def test_refuses_a_directory_without_a_tokenizer(small_hf, tmp_path):
    directory = damaged(small_hf, tmp_path)
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        (directory / name).unlink(missing_ok=True)
    refused(directory, tmp_path, f"{directory}: no tokenizer", "save_pretrained")


def test_command_line_import_names_fresh_heads(roberta_vocab, tmp_path, capsys):
    bare = tmp_path / "bare"
    hf_checkpoint(bare, "RobertaModel", roberta_vocab / "json", **CONFIGS[0])
    for name, out in (("hf-roberta", tmp_path / "a"), ("hf-xlm-roberta", tmp_path / "b")):
        assert main(["import", name, str(bare), "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "encoder-only: 2 layers" in printed and "masked-LM head (mlm_head)" in printed
        assert "next-sentence" not in printed
    assert isinstance(checkpoint.load_tokenizer(tmp_path / "a"), HFTokenizer)
    bert = damaged(bare, tmp_path, config=lambda c: c.update(model_type="bert"))
    assert main(["import", "hf-roberta", str(bert), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "model_type='bert'" in err and "Traceback" not in err


def roberta_classifier(directory, vocab_root):
    """A random RobertaForSequenceClassification (negative, positive) without dropout,
    saved with its tokenizer."""
    return hf_checkpoint(directory, "RobertaForSequenceClassification", vocab_root / "json",
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         **CONFIGS[0])


def test_a_classification_batch_gives_transformers_loss(roberta_vocab, tmp_path):
    """Fine-tuning an imported RoBERTa (<pad> at 1): the batch our training builds is
    RobertaTokenizerFast's padded encoding, and transformers'
    RobertaForSequenceClassification gives our loss on it."""
    hf = roberta_classifier(tmp_path / "hf", roberta_vocab)
    out = import_roberta(tmp_path / "hf", tmp_path / "ours")
    lines = [("positive" if i % 2 else "negative", text) for i, text in enumerate(TEXT[:10])]
    assert_a_classification_batch_gives_transformers_loss(hf, out, lines, tmp_path, pad_id=1)


EXPORTED_KINDS = ["RobertaForMaskedLM", "RobertaForSequenceClassification",
                  "XLMRobertaForMaskedLM"]


@pytest.fixture(scope="module", params=EXPORTED_KINDS)
def imported_for_export(request, roberta_vocab, xlmr_vocab, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp("exported")
    vocab = roberta_vocab / "json" if KINDS[kind] == "roberta" else xlmr_vocab
    hf = hf_checkpoint(root / "hf", kind, vocab, **CONFIGS[0])
    return kind, hf, import_roberta(root / "hf", root / "ours"), root


def test_export_hf_is_roberta_again(imported_for_export, tmp_path, capsys):
    """`export hf` of the import: a RoBERTa that AutoModel and AutoTokenizer read, with
    the original's outputs and ids (pairs included, in RoBERTa's template), which
    imports back to the same weights."""
    kind, hf, out, _ = imported_for_export
    exported = tmp_path / "hf"
    assert main(["export", "hf", str(out), str(exported)]) == 0
    auto = transformers.AutoModelForSequenceClassification if "Classification" in kind \
        else transformers.AutoModelForMaskedLM
    assert f"load it with transformers.{auto.__name__}.from_pretrained" in \
        capsys.readouterr().out
    theirs = auto.from_pretrained(str(exported)).eval()
    assert type(theirs).__name__ == kind.replace("XLMRoberta", "Roberta")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
    original = transformers.AutoTokenizer.from_pretrained(str(out.parent / "hf"))
    for text in SAMPLES[:-1] + TEXT[:3]:
        assert tokenizer(text)["input_ids"] == original(text)["input_ids"], text
    assert tokenizer("A b", "c")["input_ids"] == original("A b", "c")["input_ids"]
    ids, mask = padded_batch(out, hf.config)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).logits
        got = theirs(input_ids=ids, attention_mask=mask.long()).logits
    rows = mask if expected.dim() == 3 else slice(None)
    torch.testing.assert_close(got[rows], expected[rows], atol=1e-5, rtol=1e-5)
    again = import_roberta(exported, tmp_path / "again")
    ours, back = load_model(out).state_dict(), load_model(again).state_dict()
    fresh = set(fresh_heads(again))
    for name, tensor in ours.items():
        assert name.split(".")[0] in fresh | {"nsp_head"} or torch.equal(tensor, back[name]), \
            name


def test_export_onnx_and_ct2_compute_what_transformers_computes(imported_for_export,
                                                                tmp_path):
    """ONNX Runtime's hidden states, sentence embeddings and class logits, and
    CTranslate2's encoder's hidden states, on the import's padded rows."""
    onnxruntime = pytest.importorskip("onnxruntime")
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transduce.export import export_ctranslate2
    from transduce.export.onnx import export_onnx
    from transduce.onnx_format import SENTENCE_ENCODER

    kind, hf, out, _ = imported_for_export
    ids, mask = padded_batch(out, hf.config)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
    hidden = expected.hidden_states[-1]
    close = dict(atol=1e-5, rtol=1e-5)
    session = onnxruntime.InferenceSession(str(export_onnx(out, tmp_path / "onnx")
                                               / SENTENCE_ENCODER))
    names = [output.name for output in session.get_outputs()]
    arrays = session.run(None, {"ids": ids.numpy(), "segments": torch.zeros_like(ids).numpy()})
    graph = {name: torch.from_numpy(array) for name, array in zip(names, arrays)}
    torch.testing.assert_close(graph["hidden"][mask], hidden[mask], **close)
    real = mask.unsqueeze(-1).float()
    torch.testing.assert_close(graph["embeddings"], (hidden * real).sum(1) / real.sum(1), **close)
    if "Classification" in kind:
        torch.testing.assert_close(graph["logits"], expected.logits, **close)
    encoder = ctranslate2.Encoder(str(export_ctranslate2(out, tmp_path / "ct2")))
    lengths = mask.sum(dim=1).tolist()
    result = encoder.forward_batch([row[:n] for row, n in zip(ids.tolist(), lengths)])
    states = torch.as_tensor(np.asarray(result.last_hidden_state))
    torch.testing.assert_close(states[mask], hidden[mask], **close)


def test_export_hf_refuses_a_roberta_masked_lm_of_another_activation():
    from transduce.config import preset
    from transduce.export.common import ExportError
    from transduce.export.hf_encoder import check_bert_exportable

    config = preset("bert-tiny", src_vocab_size=50, tgt_vocab_size=50, type_vocab_size=1,
                    activation="gelu-tanh")
    with pytest.raises(ExportError, match="RobertaForMaskedLM, whose head computes exact GELU"):
        check_bert_exportable(EncoderOnly(config))
    check_bert_exportable(EncoderOnly(config.replace(num_labels=2)))     # no such head
