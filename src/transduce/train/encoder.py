"""What training an encoder (arch "encoder", BERT) adds to the loop: its data, its
losses, its dev evaluation, and loading pre-trained weights into a classifier.

Pre-training (TrainConfig.task "pretrain") reads a text corpus: objective "mlm" trains
the masked LM on [CLS] line [SEP]; "mlm,nsp" adds next-sentence prediction on
[CLS] A [SEP] B [SEP], B the next line of the file (verses are in canonical order) or a
random one. The step's loss is the mean over its masked positions of the MLM loss plus
the mean over its pairs of the NSP loss (BERT's sum of the two means), each mean taken
over every batch and process of the step, so accumulation and processes do not change
it. Fine-tuning (task "classify") reads a classification corpus and minimises the mean
cross entropy of classify_logits(pool(hidden, ids)) over the step's sentences; task "tag"
reads a tagging corpus (data/tagged.py) and minimises the mean cross entropy of
tag_logits(hidden) over the step's tagged words (their first pieces); task "answer"
reads a question-answering corpus (SQuAD's JSON) in windows (data/answer_windows.py)
and minimises BERT's span loss, the mean over the step's windows of the mean of the
start's and the end's cross entropies over each window's positions (padding excluded).

Dev: masked-LM loss and accuracy with fixed masks (the same at every evaluation), NSP
accuracy; a classifier's loss, accuracy and macro-F1; a tagger's loss, word accuracy
and entity F1 (BIO tags' spans, as conlleval counts them); or an answerer's span loss
and SQuAD's exact match and F1 of the answers `transduce answer` gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from transduce import checkpoint
from transduce.config import ConfigError, ModelConfig, TrainConfig
from transduce.data.answer_windows import TokenizedQuestions, load_qa_split
from transduce.data.batching import EncoderBatcher
from transduce.data.corpus import CorpusKind, has_split
from transduce.data.dataset import (TokenizedLabelled, TokenizedText, load_labelled_split,
                                    load_text_split)
from transduce.data.labelled import class_names
from transduce.data.masking import IGNORE, EncoderBatch, EncoderSpecials
from transduce.data.squad import Question, squad_scores
from transduce.data.tagged import TokenizedTagged, load_tagged_split, tag_names
from transduce.data.tokenizer import TextTokenizer
from transduce.errors import TransduceError
from transduce.model import empty_model
from transduce.decode.encode import SentenceEncoder
from transduce.decode.evaluate import macro_f1
from transduce.decode.tagging import entity_scores

DEV_MASK_SEED = 12345   # dev masks are fixed: the same positions at every evaluation


class EncoderTrainingError(TransduceError, RuntimeError):
    """Pre-trained weights do not fit the classifier; the message says what differs."""


def check_encoder_configs(model_config: ModelConfig, train_config: TrainConfig,
                          kind: CorpusKind, data_dir: Path) -> None:
    """Refuse an encoder run on the wrong corpus or with settings it does not use."""
    c = train_config
    if model_config.arch != "encoder":
        if c.task != "pretrain" or c.objective != "mlm":
            raise ConfigError(f"TrainConfig.task={c.task!r} / objective={c.objective!r} are "
                              f"for arch 'encoder' (BERT), not {model_config.arch!r}")
        if kind == "classification":
            raise ConfigError(f"--data {data_dir} is a classification corpus: train a "
                              f"classifier on it with --arch encoder --task classify")
        return
    wanted = {"classify": "classification", "tag": "tagging", "answer": "qa"}.get(c.task,
                                                                                "text")
    if kind != wanted:
        how = {"classification": "labelled text ({train,dev}.tsv; `transduce data "
                                 "bible-genre`)",
               "tagging": "tagged words ({train,dev}.conll, `word<TAB>tag` lines)",
               "qa": "questions with answers ({train,dev}.json in SQuAD's layout)",
               "text": "a text corpus (train.txt, dev.txt; `transduce data bible-text`)"}
        task = {"classification": "classify", "tagging": "tag", "qa": "answer"}.get(kind)
        raise ConfigError(f"arch 'encoder' with task {c.task!r} reads {how[wanted]}: --data "
                          f"{data_dir} is a {kind} corpus"
                          + (f"; pass --task {task}" if task else ""))
    if c.task == "pretrain" and c.objective == "mlm,nsp" and model_config.type_vocab_size < 2:
        raise ConfigError(f"objective 'mlm,nsp' reads pairs as segments 0 and 1, but "
                          f"ModelConfig.type_vocab_size={model_config.type_vocab_size} (a "
                          f"RoBERTa-like model has one segment, a DistilBERT none): use "
                          f"objective 'mlm'")
    if c.task in ("classify", "tag") and model_config.num_labels < 2:
        raise ConfigError(f"task {c.task!r} needs ModelConfig.num_labels >= 2 (the corpus's "
                          f"{'classes' if c.task == 'classify' else 'tags'}), got "
                          f"{model_config.num_labels}")
    if model_config.question_answering != (c.task == "answer") and c.task != "pretrain":
        raise ConfigError(f"task {c.task!r} needs ModelConfig.question_answering="
                          f"{c.task == 'answer'}, got {model_config.question_answering}")
    if model_config.token_classifier != (c.task == "tag") and c.task != "pretrain":
        raise ConfigError(f"task {c.task!r} trains a {'token' if c.task == 'tag' else 'sequence'}"
                          f" classifier, but ModelConfig.token_classifier="
                          f"{model_config.token_classifier}")
    if c.pack_length or c.dev_bleu_sentences:
        raise ConfigError("pack_length and dev_bleu_sentences are for other architectures; "
                          "an encoder batches whole lines and is scored by its own heads")
    if min(c.max_len, model_config.max_positions) > c.max_tokens:
        raise ConfigError(f"TrainConfig.max_tokens={c.max_tokens} cannot hold one sequence "
                          f"of max_len={min(c.max_len, model_config.max_positions)} tokens")


def load_encoder_data(data_dir: Path, tokenizer: TextTokenizer, model_config: ModelConfig,
                      train_config: TrainConfig
                      ) -> tuple[TokenizedText | TokenizedLabelled, EncoderBatcher,
                                 EncoderBatcher | None]:
    """-> (train split, train batcher, dev batcher or None). Sequences are cropped to
    max_len (and the model's positions), never dropped. The items are built with the
    tokenizer's specials: ours, or an imported checkpoint's ([CLS], [SEP], [MASK])."""
    c = train_config
    max_len = min(c.max_len, model_config.max_positions)
    specials = EncoderSpecials.of(tokenizer)
    if c.task == "pretrain" and specials.mask_id is None:
        raise ConfigError(f"{tokenizer.path}: the vocabulary has no mask token ([MASK] or "
                          f"<mask>), so it cannot train a masked LM")
    # Random replacements come from the tokenizer's ids: an import may have embedding
    # rows to spare, which no text reads.
    common = dict(max_tokens=c.max_tokens, max_len=max_len,
                  vocab_size=min(tokenizer.vocab_size, model_config.src_vocab_size),
                  specials=specials)
    has_dev = has_split(data_dir, "dev")
    if c.task == "answer":
        return _answering_data(data_dir, tokenizer, model_config, max_len, common, c.seed,
                               has_dev)
    if c.task == "tag":
        return _tagging_data(data_dir, tokenizer, model_config, c, common, has_dev)
    if c.task == "classify":
        names = class_names(data_dir)
        if len(names) != model_config.num_labels:
            raise ConfigError(f"{data_dir} has {len(names)} classes ({', '.join(names)}) but "
                              f"ModelConfig.num_labels={model_config.num_labels}")
        train = load_labelled_split(data_dir, "train", tokenizer, names)
        dev = load_labelled_split(data_dir, "dev", tokenizer, names) if has_dev else None
        if dev is not None and (dev.second_ids is None) != (train.second_ids is None):
            raise ConfigError(f"{dev.corpus.path} and {train.corpus.path}: one holds pairs of "
                              f"texts, the other single texts; a classifier reads one kind")
        # RoBERTa's one segment type: its pairs are <s> A </s></s> B </s>
        common["one_segment"] = model_config.type_vocab_size == 1
        batcher = EncoderBatcher(train.ids, labels=train.labels, second_ids=train.second_ids,
                                 mask=False, seed=c.seed, **common)
        dev_batcher = None if dev is None else EncoderBatcher(
            dev.ids, labels=dev.labels, second_ids=dev.second_ids, mask=False, shuffle=False,
            **common)
        return train, batcher, dev_batcher
    pairs = c.objective == "mlm,nsp"
    train = load_text_split(data_dir, "train", tokenizer)
    batcher = EncoderBatcher(train.ids, pairs=pairs, seed=c.seed, **common)
    dev = load_text_split(data_dir, "dev", tokenizer) if has_dev else None
    dev_batcher = None if dev is None else EncoderBatcher(
        dev.ids, pairs=pairs and len(dev.ids) >= 3, seed=DEV_MASK_SEED, shuffle=False,
        **common)
    return train, batcher, dev_batcher


def _tagging_data(data_dir: Path, tokenizer: TextTokenizer, model_config: ModelConfig,
                  c: TrainConfig, common: dict, has_dev: bool
                  ) -> tuple[TokenizedTagged, EncoderBatcher, EncoderBatcher | None]:
    """load_encoder_data for task "tag": the corpus's tags must be the head's."""
    names = tag_names(data_dir)
    if len(names) != model_config.num_labels:
        raise ConfigError(f"{data_dir} has {len(names)} tags ({', '.join(names[:10])}) but "
                          f"ModelConfig.num_labels={model_config.num_labels}")
    train = load_tagged_split(data_dir, "train", tokenizer, names)
    batcher = EncoderBatcher(train.ids, tags=train.tags, mask=False, seed=c.seed, **common)
    dev = load_tagged_split(data_dir, "dev", tokenizer, names) if has_dev else None
    dev_batcher = None if dev is None else EncoderBatcher(
        dev.ids, tags=dev.tags, mask=False, shuffle=False, **common)
    return train, batcher, dev_batcher


@dataclass
class DevQuestions:
    """A question answerer's dev split: its windows, batched for the span loss, and its
    questions, answered as `transduce answer` answers them for SQuAD's scores."""

    batcher: EncoderBatcher
    questions: list[Question]
    tokenizer: TextTokenizer


def _answering_data(data_dir: Path, tokenizer: TextTokenizer, model_config: ModelConfig,
                    max_len: int, common: dict, seed: int, has_dev: bool
                    ) -> tuple[TokenizedQuestions, EncoderBatcher, DevQuestions | None]:
    """load_encoder_data for task "answer": each window of max_len positions an item."""
    one_segment = model_config.type_vocab_size == 1
    common = {**common, "one_segment": one_segment}
    splits = {}
    for split in ("train", "dev") if has_dev else ("train",):
        data = splits[split] = load_qa_split(data_dir, split, tokenizer, max_len, one_segment)
        if not data.ids:
            raise ConfigError(f"{data_dir}: {split} has no question to train or score on "
                              f"({data.report[0]})")
    train = splits["train"]
    batcher = EncoderBatcher(train.ids, second_ids=train.second_ids, spans=train.spans,
                             mask=False, seed=seed, **common)
    dev = splits.get("dev")
    return train, batcher, None if dev is None else DevQuestions(
        EncoderBatcher(dev.ids, second_ids=dev.second_ids, spans=dev.spans, mask=False,
                       shuffle=False, **common), dev.questions, tokenizer)


@dataclass
class EncoderLosses:
    """Summed losses of a batch, and its correct predictions, by head."""

    sums: dict[str, Tensor]        # "mlm", "nsp", "classify", "tag", "answer": summed
    correct: dict[str, int]
    predictions: Tensor | None = None   # (B,) classes (classification), (B, T) tags


def batch_losses(net: torch.nn.Module, model: torch.nn.Module, batch: EncoderBatch,
                 *, count_correct: bool = False) -> EncoderLosses:
    """The batch's summed losses. net runs the layers (compiled / DDP-wrapped);
    model holds the heads. The MLM head runs only at the masked positions."""
    hidden = net(batch.ids, batch.segments)                                  # (B, T, C)
    if batch.spans is not None:
        return _answer_losses(model, hidden, batch)
    sums: dict[str, Tensor] = {}
    correct: dict[str, int] = {}
    predictions = None
    if batch.mlm_labels is not None:
        chosen = batch.mlm_labels != IGNORE                                  # (B, T)
        logits = model.mlm_logits(hidden[chosen]).float()                    # (N, V)
        targets = batch.mlm_labels[chosen]                                   # (N,)
        sums["mlm"] = F.cross_entropy(logits, targets, reduction="sum")
        if count_correct:
            correct["mlm"] = int((logits.argmax(-1) == targets).sum())
    if batch.labels is not None and batch.labels.dim() == 2:                 # (B, T) tags
        return _tagging_losses(model, hidden, batch.labels, count_correct)
    pooled = model.pool(hidden, batch.ids) if (
        batch.nsp_labels is not None or batch.labels is not None) else None   # (B, C)
    if batch.nsp_labels is not None:
        logits = model.nsp_logits(pooled).float()                            # (B, 2)
        sums["nsp"] = F.cross_entropy(logits, batch.nsp_labels, reduction="sum")
        if count_correct:
            correct["nsp"] = int((logits.argmax(-1) == batch.nsp_labels).sum())
    if batch.labels is not None:
        logits = model.classify_logits(pooled).float()                       # (B, K)
        sums["classify"] = F.cross_entropy(logits, batch.labels, reduction="sum")
        predictions = logits.argmax(-1)
        if count_correct:
            correct["classify"] = int((predictions == batch.labels).sum())
    return EncoderLosses(sums, correct, predictions)


def _tagging_losses(model: torch.nn.Module, hidden: Tensor, tags: Tensor,
                    count_correct: bool) -> EncoderLosses:
    """A token classifier's summed loss over the tagged pieces: hidden (B, T, C), tags
    (B, T) (IGNORE: not scored)."""
    chosen = tags != IGNORE                                                  # (B, T)
    logits = model.tag_logits(hidden[chosen]).float()                        # (N, K)
    sums = {"tag": F.cross_entropy(logits, tags[chosen], reduction="sum")}
    predictions = torch.full_like(tags, IGNORE)
    predictions[chosen] = logits.argmax(-1)
    correct = {"tag": int((predictions[chosen] == tags[chosen]).sum())} if count_correct \
        else {}
    return EncoderLosses(sums, correct, predictions)


def _answer_losses(model: torch.nn.Module, hidden: Tensor, batch: EncoderBatch
                   ) -> EncoderLosses:
    """A question answerer's summed span loss: over each window, the mean of its start's
    and its end's cross entropy over its positions (padding excluded, so that a window
    scores the same in any batch). hidden (B, T, C)."""
    logits = model.span_logits(hidden).float()                               # (B, T, 2)
    padding = (batch.ids == model.config.pad_id)[:, :, None]                 # (B, T, 1)
    logits = logits.masked_fill(padding, float("-inf"))
    starts = F.cross_entropy(logits[:, :, 0], batch.spans[:, 0], reduction="sum")
    ends = F.cross_entropy(logits[:, :, 1], batch.spans[:, 1], reduction="sum")
    return EncoderLosses({"answer": (starts + ends) / 2}, {})


class EncoderObjective(torch.nn.Module):
    """The encoder and its heads as one module whose forward is the batch's summed
    losses by head: what the training loop steps, so that DistributedDataParallel sees
    every parameter a step uses inside the forward it wraps."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: EncoderBatch) -> dict[str, Tensor]:
        return batch_losses(self.model, self.model, batch).sums


def unused_parameter_names(net: torch.nn.Module, model: torch.nn.Module,
                           train_config: TrainConfig) -> list[str]:
    """The names in `net` (the module stepped, holding `model`) of the parameters of the
    heads this run's objective never runs: the next-sentence head and the pooler in
    masked-LM pre-training, the pooler in tagging and answering too (unless it is
    ModernBERT's prediction head, which every head reads through), the masked-LM head
    (but its matrix, the token embeddings) in fine-tuning, a classifier in pre-training.
    Every other parameter gets a gradient in every step, so DistributedDataParallel, told
    to leave these alone, needs no search for unused parameters (find_unused_parameters,
    a graph traversal each step)."""
    c = train_config
    mlm = c.task == "pretrain"
    nsp = mlm and c.objective == "mlm,nsp"
    # ModernBERT's heads all read through the pooler and its norm (its prediction head).
    pooled = nsp or c.task == "classify" or (not mlm and model.config.prediction_head)
    heads = {"mlm_head": mlm, "nsp_head": nsp, "pooler": pooled, "pooler_norm": pooled,
             "classifier": not mlm}
    used, unused = {id(p) for p in model.encoder.parameters()}, set()
    for name, runs in heads.items():
        head = getattr(model, name)
        if head is not None:
            (used if runs else unused).update(id(p) for p in head.parameters())
    unused -= used      # the masked-LM head's matrix is the token embeddings
    return [name for name, p in net.named_parameters() if id(p) in unused]


def step_objective(sums: dict[str, Tensor], step_counts: dict[str, int]) -> Tensor:
    """This batch's share of the step's loss: each head's sum over the step's count
    of what it scores (so the step's loss is the sum of the heads' means)."""
    return sum(sums[name] / max(step_counts[name], 1) for name in sums)


def step_counts(batcher: EncoderBatcher, batches: list[np.ndarray]) -> dict[str, int]:
    """What each head scores in the whole step (every batch of every process)."""
    total: dict[str, int] = {}
    for indices in batches:
        for name, count in batcher.scored_counts(indices).items():
            total[name] = total.get(name, 0) + count
    return total


def evaluate_encoder(model: torch.nn.Module, dev: EncoderBatcher | DevQuestions,
                     device: torch.device) -> dict[str, float]:
    """Dev: MLM loss and accuracy over the (fixed) masked positions and NSP accuracy,
    a classifier's loss, accuracy and macro-F1, a tagger's, or an answerer's."""
    batcher = dev.batcher if isinstance(dev, DevQuestions) else dev
    model.eval()
    sums: dict[str, float] = {}
    correct: dict[str, int] = {}
    counts: dict[str, int] = {}
    predicted, gold = [], []
    with torch.no_grad():
        for position, indices in enumerate(batcher.epoch_batches(0)):
            batch = batcher.collate(indices, (0, position)).to(device)
            losses = batch_losses(model, model, batch, count_correct=True)
            for name, value in losses.sums.items():
                sums[name] = sums.get(name, 0.0) + value.item()
                correct[name] = correct.get(name, 0) + losses.correct.get(name, 0)
            for name, count in batcher.scored_counts(indices).items():
                counts[name] = counts.get(name, 0) + count
            if losses.predictions is not None:
                predicted.extend(losses.predictions.cpu())
                gold.extend(batch.labels.cpu())
    model.train()
    result: dict[str, float] = {}
    if "mlm" in sums:
        result["dev_mlm_loss"] = sums["mlm"] / counts["mlm"]
        result["dev_mlm_ppl"] = math.exp(min(result["dev_mlm_loss"], 50.0))
        result["dev_mlm_accuracy"] = correct["mlm"] / counts["mlm"]
    if "nsp" in sums:
        result["dev_nsp_loss"] = sums["nsp"] / counts["nsp"]
        result["dev_nsp_accuracy"] = correct["nsp"] / counts["nsp"]
    if "classify" in sums:
        result["dev_loss"] = sums["classify"] / counts["classify"]
        result["dev_accuracy"] = correct["classify"] / counts["classify"]
        result["dev_macro_f1"] = macro_f1(torch.stack(predicted), torch.stack(gold),
                                          model.config.num_labels)
    if "tag" in sums:
        result["dev_loss"] = sums["tag"] / counts["tag"]
        result["dev_accuracy"] = correct["tag"] / counts["tag"]
        names = model.labels or [str(i) for i in range(model.config.num_labels)]
        words = [[names[int(t)] for t in row[row != IGNORE]] for row in predicted]
        truth = [[names[int(t)] for t in row[row != IGNORE]] for row in gold]
        result["dev_entity_f1"] = entity_scores(words, truth)["f1"]
    if "answer" in sums:
        result["dev_loss"] = sums["answer"] / counts["answer"]
    if isinstance(dev, DevQuestions):
        result.update({f"dev_{name}": value
                       for name, value in _answer_scores(model, dev, device).items()})
    return result


def _answer_scores(model: torch.nn.Module, dev: DevQuestions, device: torch.device
                   ) -> dict[str, float]:
    """SQuAD's exact match and F1 of the best answers to the dev questions, found as
    `evaluate` finds them (in windows of the model's positions; the empty answer
    competing on a split of unanswerable questions)."""
    found = SentenceEncoder(model, dev.tokenizer, device).answer(
        [q.question for q in dev.questions], [q.context for q in dev.questions],
        no_answer=any(not q.answers for q in dev.questions))
    return squad_scores([answers[0].text if answers else "" for answers in found],
                        dev.questions)


NEW_HEAD = "classifier."    # the classification head's parameters: new in a fine-tuning


def load_pretrained(model: torch.nn.Module, init: Path, device: torch.device) -> list[str]:
    """Load a checkpoint's weights into `model`, an encoder: everything but the
    classification head must be there with the same shapes (the configurations may
    differ only in num_labels and token_classifier); the head is kept as initialised
    when the checkpoint has none, one of another size, or one of the other kind (a
    tagger's for a classifier, or the reverse). -> the names of the parameters not
    loaded."""
    path = checkpoint.resolve(init)
    saved_config, _ = checkpoint.read_configs(path)
    ours = model.config
    if saved_config.arch != "encoder":
        raise EncoderTrainingError(f"--init {path}: arch {saved_config.arch!r}, not an "
                                   f"encoder")
    differ = sorted(k for k, v in saved_config.replace(
        num_labels=ours.num_labels, token_classifier=ours.token_classifier,
        question_answering=ours.question_answering).to_dict().items()
        if ours.to_dict()[k] != v)
    if differ:
        raise EncoderTrainingError(f"--init {path}: its model differs from this one in "
                                   f"{', '.join(differ)} (only num_labels and the "
                                   f"head's kind may differ)")
    source = empty_model(saved_config)
    checkpoint.load_weights(source, path, device)
    weights = source.state_dict()
    target = model.state_dict()
    other_head = (saved_config.token_classifier, saved_config.question_answering) != \
        (ours.token_classifier, ours.question_answering)        # tokens', texts', spans'
    kept = {name: tensor for name, tensor in weights.items()
            if not (name.startswith(NEW_HEAD) and (name not in target or other_head
                                                    or target[name].shape != tensor.shape))}
    missing = sorted(set(target) - set(kept))
    if any(not name.startswith(NEW_HEAD) for name in missing):
        raise EncoderTrainingError(f"--init {path}: no weights for {', '.join(missing)}")
    model.load_state_dict({**target, **kept})
    return missing
