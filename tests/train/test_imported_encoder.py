"""Training an imported encoder on one's own corpus: `train --init` on a checkpoint whose
vocabulary is a tokenizer.json (BERT's WordPiece) reads the corpus with that tokenizer
and builds its items with its own [CLS], [SEP], [PAD] and [MASK] ids. Shown against
transformers (the loss of a batch we build equals BertForMaskedLM's and
BertForSequenceClassification's on BertTokenizerFast's encoding of the same lines, with
the specials at other ids than ours), and against ourselves (an exported and re-imported
copy of our model trains to the same weights as the model)."""

import random

import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import ConfigError
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.data.masking import IGNORE, SENTENCEPIECE, EncoderSpecials
from transduce.importers import import_bert
from transduce.model import load_model
from transduce.train import encoder as encoder_training
from transduce.train import loop
from transduce.train.loop import TrainingError, train
from tests.train.test_encoder import CLASSES, bert_tiny, classes, counting, dev_records, \
    train_config, weights  # noqa: F401 - classes and counting: fixtures

transformers = pytest.importorskip("transformers")

# The specials away from 0-4, as no SentencePiece model of ours has them, and a word
# ("zero") the vocabulary cannot spell: WordPiece makes it [UNK].
WORDS = sorted({word for words in CLASSES.values() for word in words})
VOCAB = (WORDS[:3] + ["[UNK]"] + WORDS[3:6] + ["[PAD]", "[MASK]"] + WORDS[6:]
         + ["[SEP]", "[CLS]", "."] + list("abcdefghijklmnopqrstuvwxy"))
PAD, MASK, UNK = VOCAB.index("[PAD]"), VOCAB.index("[MASK]"), VOCAB.index("[UNK]")
CLS, SEP = VOCAB.index("[CLS]"), VOCAB.index("[SEP]")


@pytest.fixture(scope="module")
def hf_bert(tmp_path_factory):
    """A random BertForMaskedLM of our vocabulary, saved as transformers saves it."""
    directory = tmp_path_factory.mktemp("hf-bert")
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(directory))
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=48,
                                     max_position_embeddings=40, pad_token_id=PAD,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    transformers.BertForMaskedLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def imported(hf_bert, tmp_path_factory):
    return import_bert(hf_bert, tmp_path_factory.mktemp("imported") / "bert")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """A text corpus and a labelled one over the class words, some lines with an
    unknown word; neither has a vocabulary of its own."""
    root = tmp_path_factory.mktemp("corpora")
    rng = random.Random(0)
    text, labelled = root / "text", root / "labelled"
    text.mkdir(), labelled.mkdir()
    for split, size in (("train", 60), ("dev", 12)):
        lines = []
        for _ in range(size):
            label = rng.choice(sorted(CLASSES))
            words = [rng.choice(CLASSES[label]) for _ in range(rng.randint(2, 7))]
            if rng.random() < 0.3:
                words.insert(rng.randint(0, len(words)), "zero")
            lines.append((label, " ".join(words)))
        (text / f"{split}.txt").write_text("".join(f"{line}\n" for _, line in lines))
        (labelled / f"{split}.tsv").write_text("".join(f"{label}\t{line}\n"
                                                       for label, line in lines))
    for directory, kind in ((text, "text"), (labelled, "classification")):
        (directory / "corpus.json").write_text(f'{{"kind": "{kind}", "lang": "en"}}')
    return text, labelled


def test_the_specials_are_the_vocabularys(imported):
    tokenizer = checkpoint.load_tokenizer(imported)
    specials = EncoderSpecials.of(tokenizer)
    assert (specials.cls_id, specials.sep_id, specials.pad_id, specials.mask_id) == \
        (CLS, SEP, PAD, MASK)
    assert set(specials.special) == {CLS, SEP, PAD, MASK, UNK}
    replacements = specials.replacements(len(VOCAB)).tolist()
    assert len(replacements) == len(VOCAB) - 5 and not set(replacements) & {CLS, SEP, PAD, MASK}


def batch_of(imported, data, task, train_config_values):
    """The first training batch our loop builds for `task` from the imported model."""
    model_config, _ = checkpoint.read_configs(imported)
    tokenizer = loop._training_tokenizer(data, imported, model_config)
    assert isinstance(tokenizer, HFTokenizer)
    if task == "classify":
        model_config = model_config.replace(num_labels=len(CLASSES))
    config = train_config(task=task, max_tokens=400, **train_config_values)
    split, batcher, _ = encoder_training.load_encoder_data(data, tokenizer, model_config, config)
    indices = batcher.epoch_batches(0)[0]
    return split, batcher.collate(indices, (0, 0)), indices


def test_a_masked_lm_batch_gives_transformers_loss(hf_bert, imported, corpora):
    """Our masked batch, unmasked, is BertTokenizerFast's padded encoding of its lines;
    masked, transformers' BertForMaskedLM gives our loss on it."""
    split, batch, indices = batch_of(imported, corpora[0], "pretrain", {})
    fast = transformers.BertTokenizerFast.from_pretrained(str(hf_bert))
    lines = [split.corpus.lines[i] for i in indices]
    expected = fast(lines, padding=True, return_tensors="pt")
    chosen = batch.mlm_labels != IGNORE
    unmasked = torch.where(chosen, batch.mlm_labels, batch.ids)
    assert torch.equal(unmasked, expected["input_ids"])
    assert (batch.ids == PAD).any() and (unmasked == UNK).any()     # padding, unknown words
    assert not (chosen & ((unmasked == CLS) | (unmasked == SEP) | (unmasked == PAD))).any()
    assert (batch.ids[chosen] == MASK).any()
    replaced = chosen & (batch.ids != MASK) & (batch.ids != unmasked)
    assert not torch.isin(batch.ids[replaced], torch.tensor([CLS, SEP, PAD, MASK])).any()
    theirs = transformers.BertForMaskedLM.from_pretrained(str(hf_bert)).eval()
    ours = load_model(imported).eval()
    with torch.no_grad():
        expected_loss = theirs(input_ids=batch.ids, attention_mask=expected["attention_mask"],
                               labels=batch.mlm_labels).loss
        losses = encoder_training.batch_losses(ours, ours, batch)
    torch.testing.assert_close(losses.sums["mlm"] / chosen.sum(), expected_loss,
                               atol=1e-5, rtol=1e-5)


def test_random_replacements_are_the_tokenizers_ids(imported, corpora):
    """An import with embedding rows to spare (a vocabulary padded to a multiple of 8)
    never puts a row no text reads into a masked item."""
    model_config, _ = checkpoint.read_configs(imported)
    spare = model_config.replace(src_vocab_size=len(VOCAB) + 40, tgt_vocab_size=len(VOCAB) + 40)
    tokenizer = checkpoint.load_tokenizer(imported)
    _, batcher, _ = encoder_training.load_encoder_data(corpora[0], tokenizer, spare,
                                                       train_config(max_tokens=400))
    seen = torch.cat([batcher.collate(indices, (epoch, 0)).ids.flatten() for epoch in range(20)
                      for indices in batcher.epoch_batches(epoch)])
    assert seen.max() < len(VOCAB) and len(seen.unique()) > 20


def test_a_classification_batch_gives_transformers_loss(hf_bert, imported, corpora):
    split, batch, indices = batch_of(imported, corpora[1], "classify", {})
    fast = transformers.BertTokenizerFast.from_pretrained(str(hf_bert))
    encoded = fast([split.corpus.texts[i] for i in indices], padding=True, return_tensors="pt")
    assert torch.equal(batch.ids, encoded["input_ids"])
    model = load_model(imported)
    ours = type(model)(model.config.replace(num_labels=len(CLASSES), dropout=0.0))
    encoder_training.load_pretrained(ours, imported, torch.device("cpu"))
    ours.eval()
    theirs = transformers.BertForSequenceClassification.from_pretrained(
        str(hf_bert), num_labels=len(CLASSES)).eval()
    with torch.no_grad():   # the heads the BERT lacked: ours
        theirs.bert.pooler.dense.weight.copy_(ours.pooler.weight)
        theirs.bert.pooler.dense.bias.copy_(ours.pooler.bias)
        theirs.classifier.weight.copy_(ours.classifier.weight)
        theirs.classifier.bias.copy_(ours.classifier.bias)
        expected = theirs(**encoded, labels=batch.labels).loss
        losses = encoder_training.batch_losses(ours, ours, batch)
    torch.testing.assert_close(losses.sums["classify"] / len(indices), expected,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("task", ["pretrain", "classify"])
def test_an_imported_bert_trains_on_a_corpus_without_a_vocabulary(imported, corpora, tmp_path,
                                                                  task):
    """Fine-tuning and further pre-training from the command line, resumed across a
    removed first checkpoint (keep_last 1): each checkpoint keeps the tokenizer.json and
    its specials, and the model learns (the classifier: most dev lines right)."""
    data = corpora[1] if task == "classify" else corpora[0]
    run = tmp_path / "run"
    common = ["train", "--data", str(data), "--out", str(run), "--max-tokens", "200",
              "--dtype", "float32", "--keep-last", "1", "--save-every", "40",
              "--eval-every", "80", "--warmup-steps", "10"]
    # A random model: further pre-training an import warms up to a rate chosen for
    # pre-trained weights (cli/train.py: IMPORT_TRAINING), too low to learn from scratch.
    faster = ["--lr-scale", "1"] if task == "pretrain" else []
    assert main([*common, "--init", str(imported), "--task", task, "--max-steps", "40",
                 *faster]) == 0
    assert main([*common, "--resume", "--max-steps", "80"]) == 0
    latest = checkpoint.resolve(run)
    assert latest.name == "step-0000080" and checkpoint.list_checkpoints(run) == [latest]
    tokenizer = checkpoint.load_tokenizer(latest)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.specials == {"bos_id": CLS, "eos_id": SEP, "pad_id": PAD, "mask_id": MASK}
    last = dev_records(run)[-1]
    if task == "classify":
        assert last["dev_accuracy"] > 0.9, last
    else:   # from the random model's (~ln 43) to about the words' unigram entropy (ln 12)
        model_config, _ = checkpoint.read_configs(imported)
        dev = encoder_training.load_encoder_data(data, tokenizer, model_config,
                                                 train_config(max_tokens=200))[2]
        before = encoder_training.evaluate_encoder(load_model(imported), dev,
                                                   torch.device("cpu"))
        assert last["dev_mlm_loss"] < min(2.6, before["dev_mlm_loss"] - 1.0), (before, last)


@pytest.fixture(scope="module")
def exported_copy(counting, tmp_path_factory):
    """(our pre-trained BERT, its `export hf` read back by `import hf-bert`: a
    tokenizer.json of the same ids, [MASK] recorded as the unknown piece)."""
    root = tmp_path_factory.mktemp("copy")
    train(counting, root / "pre", bert_tiny(),
          train_config(max_steps=2, max_tokens=128, objective="mlm,nsp"))
    assert main(["export", "hf", str(root / "pre"), str(root / "hf")]) == 0
    return root / "pre", import_bert(root / "hf", root / "copy")


@pytest.mark.parametrize("objective", ["mlm", "mlm,nsp"])
def test_an_exported_and_imported_copy_masks_as_ours(exported_copy, counting, objective):
    """Pre-training batches from the copy's tokenizer.json equal those from our
    SentencePiece model: the same ids, pairs and masks."""
    batches, specials = [], []
    for source in exported_copy:
        directory = checkpoint.resolve(source)
        model_config, _ = checkpoint.read_configs(directory)
        tokenizer = loop._training_tokenizer(counting, directory, model_config)
        specials.append(EncoderSpecials.of(tokenizer))
        config = train_config(max_tokens=128, objective=objective)
        _, batcher, _ = encoder_training.load_encoder_data(counting, tokenizer, model_config,
                                                           config)
        batches.append([batcher.collate(indices, (1, position)) for position, indices
                        in enumerate(batcher.epoch_batches(1))])
    assert isinstance(tokenizer, HFTokenizer) and len(batches[0]) == len(batches[1]) > 2
    assert specials[0] is SENTENCEPIECE and specials[1] == SENTENCEPIECE   # the same ids
    for ours, theirs in zip(*batches):
        for name in ("ids", "segments", "mlm_labels", "nsp_labels"):
            a, b = getattr(ours, name), getattr(theirs, name)
            assert (a is None and b is None) or torch.equal(a, b), name


def test_an_exported_and_imported_copy_fine_tunes_as_ours(exported_copy, classes, tmp_path):
    """Fine-tuned alike from the command line: the same weights."""
    for source, out in zip(exported_copy, (tmp_path / "ours", tmp_path / "copy")):
        assert main(["train", "--data", str(classes), "--out", str(out), "--init", str(source),
                     "--task", "classify", "--max-steps", "3", "--max-tokens", "128",
                     "--dtype", "float32"]) == 0
    ours, theirs = weights(tmp_path / "ours"), weights(tmp_path / "copy")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_refusals(imported, corpora, tmp_path):
    model_config, _ = checkpoint.read_configs(imported)
    with pytest.raises(TrainingError, match="a 'transformer' model trains on a SentencePiece"):
        loop._training_tokenizer(corpora[0], imported, model_config.replace(arch="transformer"))
    config = train_config(objective="mlm,nsp")
    with pytest.raises(ConfigError, match="type_vocab_size=1"):
        encoder_training.check_encoder_configs(
            model_config.replace(type_vocab_size=1), config, "text", corpora[0])
    unmasked = checkpoint.load_tokenizer(imported)
    unmasked._mask_id = None
    with pytest.raises(ConfigError, match="no mask token"):
        encoder_training.load_encoder_data(corpora[0], unmasked, model_config, train_config())
    with pytest.raises(TrainingError, match="pad id"):
        loop._check_vocabulary(model_config.replace(pad_id=0), unmasked)
    with pytest.raises(TrainingError, match="src_vocab_size=8"):
        loop._check_vocabulary(model_config.replace(src_vocab_size=8, tgt_vocab_size=8),
                               unmasked)
