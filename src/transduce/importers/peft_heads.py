"""What a PEFT adapter of a sequence classifier holds besides its LoRA matrices: the
modules it trained whole (modules_to_save), saved as the weights themselves (a language
model's, its vocabulary matrices: importers/peft_vocabulary.py). On
BertForSequenceClassification they are its classifier and pooler; on
RobertaForSequenceClassification its classifier, whose dense layer is our pooler and
whose out_proj is our classifier; on DistilBertForSequenceClassification its
pre_classifier (our pooler) and classifier; on ModernBERT's task models, for every task,
its head (our pooler and its norm) and classifier (importers/encoder_names.py). A base
without a classifier of that many classes gets one (classes named LABEL_0, LABEL_1, ...
as transformers names them), which the adapter's weights then fill.
"""

from __future__ import annotations

import torch
from torch import Tensor

from transduce.data.answer_windows import SPAN_LABELS
from transduce.importers import ForeignCheckpointError
from transduce.importers.encoder_names import encoder_names
from transduce.model import EncoderOnly, empty_model

# PEFT's modules_to_save names that a classifier's whole modules may go under (a question
# answerer's: qa_outputs), and a language model's vocabulary matrices.
HEAD_MODULES = {"classifier", "score", "pooler", "pre_classifier", "qa_outputs", "head"}
# What a head reads by PEFT's task_type: the text's [CLS] (SEQ_CLS, and by default), each
# token (TOKEN_CLS), each token's starting or ending the answer (QUESTION_ANS).
HEAD_KINDS = {"TOKEN_CLS": "tokens", "QUESTION_ANS": "spans"}
VOCABULARY_NAMES = {"lm_head", "embed_tokens", "wte"}


def check_modules_to_save(settings: dict, arch: str, file) -> None:
    """modules_to_save is a classifier's head (and pooler), on an encoder, or a language
    model's vocabulary matrices (importers/peft_vocabulary.py)."""
    saved = settings.get("modules_to_save") or []
    allowed = {"encoder": HEAD_MODULES, "decoder": VOCABULARY_NAMES}.get(arch, set())
    if saved and not set(saved) <= allowed:
        raise ForeignCheckpointError(f"{file}: modules_to_save={saved} is not supported (only "
                                     f"a sequence classifier's {sorted(HEAD_MODULES)}, on an "
                                     f"encoder, and a language model's "
                                     f"{sorted(VOCABULARY_NAMES)})")


@torch.no_grad()
def with_heads(model: EncoderOnly, whole: dict[str, Tensor], file, kind: str = "texts"
               ) -> EncoderOnly:
    """`model` with the adapter's trained-whole weights (transformers' names without
    PEFT's prefix) in place; another number of classes than the base's, or a head of
    another kind (HEAD_KINDS: a token classifier's, a question answerer's) than the
    base's: a new classifier."""
    head = encoder_names(model.config).classifier_head if model.config.prediction_head \
        else {"tokens": {"classifier": "classifier"}, "spans": {"qa_outputs": "classifier"}
              }.get(kind) or encoder_names(model.config).classifier_head
    names = {f"{theirs}.{kind}": f"{ours}.{kind}" for kind in ("weight", "bias")
             for theirs, ours in head.items()}
    unknown = sorted(set(whole) - set(names))
    if unknown:
        raise ForeignCheckpointError(f"{file}: {unknown[0]} is neither a LoRA matrix nor a "
                                     f"weight of the classifier's head or pooler")
    classes = next((tensor.shape[0] for name, tensor in whole.items()
                    if names[name] == "classifier.weight"), model.config.num_labels)
    if classes != model.config.num_labels or (kind == "tokens", kind == "spans") != (
            model.config.token_classifier, model.config.question_answering):
        model = _with_classes(model, classes, kind)
    ours = dict(model.named_parameters())
    for name, tensor in whole.items():
        target = ours[names[name]]
        if target.shape != tensor.shape:
            raise ForeignCheckpointError(f"{file}: {name} has shape {tuple(tensor.shape)}, "
                                         f"the base's {tuple(target.shape)}")
        target.copy_(tensor)
    return model


def _with_classes(model: EncoderOnly, classes: int, kind: str) -> EncoderOnly:
    """A copy of the encoder with a classifier of `classes` outputs (left as drawn: the
    adapter fills it), of the kind of head with_heads says, in place of its own or of
    none."""
    grown = empty_model(model.config.replace(num_labels=classes,
                                             token_classifier=kind == "tokens",
                                             question_answering=kind == "spans"))
    kept = {name: tensor for name, tensor in model.state_dict().items()
            if not name.startswith("classifier.")}
    missing, unexpected = grown.load_state_dict(kept, strict=False)
    assert not unexpected and all(name.startswith("classifier.") for name in missing)
    grown.labels = list(SPAN_LABELS) if kind == "spans" else \
        [f"LABEL_{i}" for i in range(classes)]
    grown.classifier_inputs = None if kind != "texts" else \
        getattr(model, "classifier_inputs", None) or "texts"
    grown.sentence_embedding = getattr(model, "sentence_embedding", None)
    return grown.eval()
