"""Where transformers' BERT, RoBERTa, DistilBERT, ELECTRA and DeBERTa keep what our
EncoderOnly holds: one table for the imports (hf_bert.py), `export hf`
(export/hf_encoder.py) and PEFT adapters (peft_layout.py, peft_heads.py), so that the
three cannot drift apart; ModernBERT's names, for PEFT's adapters (its import and export
have their own table).

Our encoder exports as DeBERTa with disentangled positions, as ModernBERT with a
prediction head, as ELECTRA with a GELU after its pooler (ELECTRA's classification
head), else as DistilBERT without segment types, as RoBERTa with one, as BERT with more
(encoder_names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transduce.config import ModelConfig

# Our module in an EncoderLayer -> BERT's (and RoBERTa's) under encoder.layer.N.
BERT_LAYER = {"self_attn.q_proj": "attention.self.query", "self_attn.k_proj": "attention.self.key",
              "self_attn.v_proj": "attention.self.value",
              "self_attn.out_proj": "attention.output.dense",
              "norm1": "attention.output.LayerNorm", "ffn.linear1": "intermediate.dense",
              "ffn.linear2": "output.dense", "norm2": "output.LayerNorm"}
# ... and DistilBERT's, under transformer.layer.N.
DISTILBERT_LAYER = {"self_attn.q_proj": "attention.q_lin", "self_attn.k_proj": "attention.k_lin",
                    "self_attn.v_proj": "attention.v_lin",
                    "self_attn.out_proj": "attention.out_lin", "norm1": "sa_layer_norm",
                    "ffn.linear1": "ffn.lin1", "ffn.linear2": "ffn.lin2",
                    "norm2": "output_layer_norm"}


@dataclass(frozen=True, eq=False)
class EncoderNames:
    """A family's names: its task models' prefix, its layers' path and modules, its
    segment table (None: it has none), and its sequence classifier's head. Each family
    is one object (compared, and looked up, by identity)."""

    family: str                     # its name in messages ("BERT")
    prefix: str                     # of the task models' encoder weights ("bert.")
    layers: str                     # the layers' path under it ("encoder.layer")
    layer: dict[str, str]           # our module in a layer -> theirs
    segments: str | None            # the segment (token type) table, if any
    # What its tokenizer gives the model (`export hf` writes them down: transformers'
    # default depends on its version, and DistilBERT's forward refuses token_type_ids).
    model_inputs: tuple[str, ...]
    # The sequence classifier's modules outside the encoder, by their full name -> ours;
    # what follows the pooler there; what PEFT's modules_to_save calls them.
    classifier_head: dict[str, str]
    pooler_activation: str
    modules_to_save: tuple[str, ...]
    # Which part of a module of theirs our layer is, where one holds several (ModernBERT's
    # Wqkv: q, k, v; its Wi: linear1, linear3): our module -> its part, in row order.
    parts: dict[str, int] = field(default_factory=dict)

    def layer_module(self, index: int, ours: str) -> str:
        """Their name (without the task prefix) of our module `ours` in layer `index`."""
        return f"{self.layers}.{index}.{self.layer[ours]}"


BERT = EncoderNames("BERT", "bert.", "encoder.layer", BERT_LAYER,
                    "embeddings.token_type_embeddings",
                    ("input_ids", "token_type_ids", "attention_mask"),
                    {"bert.pooler.dense": "pooler", "classifier": "classifier"}, "tanh",
                    ("classifier", "pooler"))
ROBERTA = EncoderNames("RoBERTa", "roberta.", "encoder.layer", BERT_LAYER,
                       "embeddings.token_type_embeddings", ("input_ids", "attention_mask"),
                       {"classifier.dense": "pooler", "classifier.out_proj": "classifier"},
                       "tanh", ("classifier",))
DISTILBERT = EncoderNames("DistilBERT", "distilbert.", "transformer.layer", DISTILBERT_LAYER,
                          None, ("input_ids", "attention_mask"),
                          {"pre_classifier": "pooler", "classifier": "classifier"}, "relu",
                          ("pre_classifier", "classifier"))


ELECTRA = EncoderNames("ELECTRA", "electra.", "encoder.layer", BERT_LAYER,
                       "embeddings.token_type_embeddings",
                       ("input_ids", "token_type_ids", "attention_mask"),
                       {"classifier.dense": "pooler", "classifier.out_proj": "classifier"},
                       "gelu", ("classifier",))


# DeBERTa's: BERT's layers with its own projections' names, and a GELU after the pooler.
DEBERTA_LAYER = {**BERT_LAYER, "self_attn.q_proj": "attention.self.query_proj",
                 "self_attn.k_proj": "attention.self.key_proj",
                 "self_attn.v_proj": "attention.self.value_proj"}
DEBERTA = EncoderNames("DeBERTa", "deberta.", "encoder.layer", DEBERTA_LAYER,
                       "embeddings.token_type_embeddings",
                       ("input_ids", "token_type_ids", "attention_mask"),
                       {"pooler.dense": "pooler", "classifier": "classifier"}, "gelu",
                       ("pooler", "classifier"))


# ModernBERT's names (under model.layers.N), for PEFT's adapters: the import and `export
# hf` join and split its fused modules themselves (importers/hf_modernbert.py).
MODERNBERT_LAYER = {"self_attn.q_proj": "attn.Wqkv", "self_attn.k_proj": "attn.Wqkv",
                    "self_attn.v_proj": "attn.Wqkv", "self_attn.out_proj": "attn.Wo",
                    "ffn.linear1": "mlp.Wi", "ffn.linear3": "mlp.Wi",
                    "ffn.linear2": "mlp.Wo"}
MODERNBERT = EncoderNames("ModernBERT", "model.", "layers", MODERNBERT_LAYER, None,
                          ("input_ids", "attention_mask"),
                          {"head.dense": "pooler", "head.norm": "pooler_norm",
                           "classifier": "classifier"}, "gelu", ("head", "classifier"),
                          parts={"self_attn.k_proj": 1, "self_attn.v_proj": 2,
                                 "ffn.linear3": 1})


def encoder_names(config: ModelConfig) -> EncoderNames:
    """The family our encoder exports as: DeBERTa with disentangled positions,
    ModernBERT with its prediction head, ELECTRA
    with its GELU pooler, else DistilBERT without segment types, RoBERTa with one (it
    could not read a second segment of BERT's template), BERT with more."""
    if config.positional == "disentangled":
        return DEBERTA
    if config.prediction_head:
        return MODERNBERT
    if config.pooler_activation == "gelu":
        return ELECTRA
    return {0: DISTILBERT, 1: ROBERTA}.get(config.type_vocab_size, BERT)
