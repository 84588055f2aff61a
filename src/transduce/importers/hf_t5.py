"""Hugging Face T5 (T5ForConditionalGeneration or T5Model directories: T5, T5 v1.1,
Flan-T5, mT5) -> our Transformer.

T5 is the encoder-decoder in pre-norm with relative positions: RMSNorm before every
sublayer and after each stack, no biases anywhere, no position table but a learned bias
on the self-attention scores per head and distance bucket (positional="t5": each stack's
first layer holds the table, which all its layers read; cross-attention has none), a
feed-forward network that is ReLU (T5) or gated GELU (v1.1, Flan-T5, mT5), and one
matrix embedding both sides. Three things are folded into the weights, so that the
model runs on our fastest paths and exports as ours do:

- T5 does not scale its scores by 1/sqrt(d_kv) (its initialisation does instead): each
  query projection is multiplied by sqrt(d_kv), which our kernels' scale cancels;
- the original T5 ties the output to the embedding and scales the decoder's last
  states by d_model^-0.5 first (transformers' scale_decoder_outputs, or older configs'
  tie_word_embeddings): the decoder's final RMSNorm gain takes that factor;
- v1.1 and its heirs keep an lm_head of their own: tie_embeddings="embeddings".

Heads need not be d_model / num_heads wide (d_kv: v1.1-small has 6 heads of 64 in 512,
our head_size). The ids: spiece.model's pad 0, </s> 1, <unk> 2, then its pieces, then
the sentinels <extra_id_99> ... <extra_id_0> (extra_ids of tokenizer_config.json, 100
by default, none where spiece.model holds them as pieces, as mT5's does). Ours put pad,
bos, eos, unk first: the vocabulary is merged as Marian's is (marian_vocabulary.py),
bos taking the row of pad, where T5's decoder starts, and the sentinels becoming
pieces of their own. Rows past the tokenizer's (32128 - 32100 in
T5's) are dropped; pad and bos are never output.

    shared / encoder.embed_tokens / decoder.embed_tokens    the embedding (one matrix)
    lm_head (if it differs from shared)                     output_proj
    STACK.block.0.layer.0.SelfAttention.relative_attention_bias   STACK.score_bias.table
    encoder.block.N.layer.0.SelfAttention.{q,k,v,o}         encoder.layers.N.self_attn
    encoder.block.N.layer.0.layer_norm                      encoder.layers.N.norm1
    encoder.block.N.layer.1.DenseReluDense.wi (or wi_0 and wi_1), wo
                                                            .ffn.linear1 (, .linear3), .linear2
    encoder.block.N.layer.1.layer_norm                      encoder.layers.N.norm2
    decoder.block.N.layer.0 / layer.1.EncDecAttention / layer.2   self_attn / cross_attn / ffn
    STACK.final_layer_norm                                  STACK.final_norm

Every key is accounted for; the cross-attention bias table old checkpoints carry (which
T5 never reads) is ignored. UMT5 (a table per layer) and other bucket counts or
distances are refused by name.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from transduce.config import ConfigError, ModelConfig
from transduce.data.tokenizer import BOS_ID, PAD_ID
from transduce.importers import ForeignCheckpointError, check_directories, \
    check_type_and_fixed_options, refuse_unread, take_weight
from transduce.importers.hf_gpt2 import HF_CONFIG, _read_json, read_weights, tokenizer_settings
from transduce.importers.hf_marian import check_vocab, save_with_vocabulary
from transduce.importers.marian_vocabulary import MarianVocabulary, merged_vocabulary
from transduce.model import empty_model
from transduce.model.transformer import NEVER_OUTPUT

SPM_FILE, TOKENIZER_JSON = "spiece.model", "tokenizer.json"
MODEL_TYPES = ("t5", "mt5")
# What our T5Bias computes (attention/position_bias.py); every released T5 has these.
BUCKETS = 32
FIXED_OPTIONS = {"relative_attention_num_buckets": BUCKETS,
                 "relative_attention_max_distance": 128, "is_encoder_decoder": True}
# transformers' activation names (feed_forward_proj's last part) -> ModelConfig.activation
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu-tanh",
               "gelu_pytorch_tanh": "gelu-tanh", "silu": "silu", "swish": "silu"}
# Each stack's sublayers in T5's order (block N's layer.0, layer.1, ...): its attention's
# name, ours and our norm before it, then the feed-forward network's norm (export/hf_t5.py
# writes the same names back).
SUBLAYERS = {"encoder": (("SelfAttention", "self_attn", "norm1"),),
             "decoder": (("SelfAttention", "self_attn", "norm1"),
                         ("EncDecAttention", "cross_attn", "norm2"))}
FFN_NORM = {"encoder": "norm2", "decoder": "norm3"}
DEFAULT_EXTRA_IDS = 100
DEFAULT_POSITIONS = 512        # T5's n_positions: what it was trained on, not a table
SENTINEL = re.compile(r"^<extra_id_(\d+)>$")
# Read by no T5: old checkpoints stored a relative-position table for cross-attention too.
IGNORED = re.compile(r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.")


def import_t5(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face T5 directory (config.json, model.safetensors or
    pytorch_model.bin, spiece.model) and write it as our checkpoint at `out`, replacing
    one there; nothing is written unless everything was read and checked."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_directories(hf_dir, out, HF_CONFIG)
    config_file = hf_dir / HF_CONFIG
    hf = _read_json(config_file)
    activation, gated = read_options(hf, config_file)
    vocabulary = read_vocabulary(hf_dir, hf)
    tensors, source = read_weights(hf_dir)
    weights = T5Weights(tensors, source, hf["vocab_size"], hf.get("d_model"))
    config = model_config(hf, config_file, activation, gated, len(vocabulary.marian_ids),
                          untied=weights.untied_output())
    model = empty_model(config)     # every weight is loaded next
    model.load_state_dict(weights.state_dict(config, vocabulary, scaled_output(hf)))
    del tensors, weights     # the stored files are let go before the save copies the model
    return save_with_vocabulary(out, model, vocabulary, "hf-t5", hf_dir)


def read_options(hf: dict[str, Any], config_file: Path) -> tuple[str, bool]:
    """config.json's model type and fixed options checked -> (our activation, gated)."""
    check_type_and_fixed_options(hf, config_file, MODEL_TYPES, FIXED_OPTIONS)  # not UMT5
    projection = hf.get("feed_forward_proj", "relu")
    parts = projection.split("-") if isinstance(projection, str) else []
    gated = len(parts) == 2 and parts[0] == "gated"
    name = "gelu_new" if projection == "gated-gelu" else (parts[-1] if parts else None)
    if len(parts) not in (1, 2) or (len(parts) == 2 and not gated) or name not in ACTIVATIONS:
        raise ForeignCheckpointError(f"{config_file}: feed_forward_proj={projection!r} is not "
                                     f"supported (an activation of {', '.join(ACTIVATIONS)}, "
                                     f"or gated-<activation>)")
    return ACTIVATIONS[name], gated


def scaled_output(hf: dict[str, Any]) -> bool:
    """Whether the decoder's last states are scaled by d_model^-0.5 before the output:
    transformers 5 says so in scale_decoder_outputs, older configs by tying the output
    (tie_word_embeddings, true unless said otherwise)."""
    if "scale_decoder_outputs" in hf:
        return hf["scale_decoder_outputs"] is True
    return hf.get("tie_word_embeddings", True) is not False


def read_vocabulary(hf_dir: Path, hf: dict[str, Any]) -> MarianVocabulary:
    """spiece.model's pieces under their ids and the sentinels after them, checked against
    config.json (and tokenizer.json's ids, where there is one), merged into ours."""
    specials, options = tokenizer_settings(
        hf_dir, {"eos": "</s>", "unk": "<unk>", "pad": "<pad>"}, ("extra_ids",))
    spm_file = hf_dir / SPM_FILE
    if not spm_file.is_file():
        raise ForeignCheckpointError(f"{hf_dir}: no {SPM_FILE} (T5's tokenizer segments "
                                     f"with it)")
    import sentencepiece as spm

    try:
        processor = spm.SentencePieceProcessor(model_file=str(spm_file))
    except (RuntimeError, OSError) as error:
        raise ForeignCheckpointError(f"{spm_file}: not a readable SentencePiece model "
                                     f"({error})") from None
    size = processor.get_piece_size()
    vocab = {processor.id_to_piece(i): i for i in range(size)}
    # mT5's spiece.model holds its sentinels (▁<extra_id_0>...): none to add then.
    held = any(SENTINEL.match(piece.removeprefix("\u2581")) for piece in vocab)
    extra = options.get("extra_ids", 0 if held else DEFAULT_EXTRA_IDS)
    if not isinstance(extra, int) or isinstance(extra, bool) or extra < 0:
        raise ForeignCheckpointError(f"{hf_dir / 'tokenizer_config.json'}: extra_ids="
                                     f"{extra!r}; expected a count")
    sentinels = {f"<extra_id_{n}>": size + extra - 1 - n for n in range(extra)}
    vocab.update(sentinels)
    _check_tokenizer_ids(hf_dir / TOKENIZER_JSON, sentinels)
    check_vocab(vocab, hf, spm_file, hf_dir / HF_CONFIG, specials)
    start = hf.get("decoder_start_token_id", vocab[specials["pad"]])
    if not isinstance(start, int) or start not in set(vocab.values()):
        raise ForeignCheckpointError(f"{hf_dir / HF_CONFIG}: decoder_start_token_id={start!r} "
                                     f"is not an id of {SPM_FILE} or a sentinel")
    return merged_vocabulary(spm_file, None, vocab, **specials, decoder_start=start,
                             codes=frozenset(sentinels))


def _check_tokenizer_ids(file: Path, sentinels: dict[str, int]) -> None:
    """tokenizer.json, where there is one, must give each sentinel it adds the id we do."""
    if not file.is_file():
        return
    added = _read_json(file).get("added_tokens")
    for token in added if isinstance(added, list) else []:
        content = token.get("content") if isinstance(token, dict) else None
        if isinstance(content, str) and SENTINEL.match(content) and \
                sentinels.get(content) != token.get("id"):
            raise ForeignCheckpointError(f"{file}: {content} is id {token.get('id')!r}, but "
                                         f"{SPM_FILE} and extra_ids make it "
                                         f"{sentinels.get(content)!r}")


def model_config(hf: dict[str, Any], config_file: Path, activation: str, gated: bool,
                 vocab_size: int, *, untied: bool) -> ModelConfig:
    """Our ModelConfig of a T5 configuration; `untied`: the output has a matrix of its own."""
    def required(name: str) -> Any:
        if name not in hf:
            raise ForeignCheckpointError(f"{config_file}: no {name!r}")
        return hf[name]

    d_model, heads, d_kv = required("d_model"), required("num_heads"), required("d_kv")
    layers = required("num_layers")
    try:
        return ModelConfig(
            src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, d_model=d_model,
            num_heads=heads, head_size=None if d_kv * heads == d_model else d_kv,
            d_ff=required("d_ff"), num_encoder_layers=layers,
            num_decoder_layers=hf.get("num_decoder_layers") or layers,
            dropout=hf.get("dropout_rate", 0.1), attention_dropout=hf.get("dropout_rate", 0.1),
            activation=activation, gated_ffn=gated, norm="rms", norm_first=True,
            positional="t5", max_positions=hf.get("n_positions") or DEFAULT_POSITIONS,
            tie_embeddings="embeddings" if untied else "all", bias=False,
            layer_norm_eps=hf.get("layer_norm_epsilon", 1e-6), pad_id=PAD_ID,
            scale_embeddings=False, output_bias=True)
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None


class T5Weights:
    """The stored tensors of T5's layout, each read once into our state dict."""

    def __init__(self, tensors, source: Path, vocab_size: int, d_model: Any):
        self.tensors, self.source = tensors, source
        self.names = {name: name for name in tensors}        # what is left to read
        self.vocab_size, self.d_model = vocab_size, d_model
        self.shared = self._shared()

    def take(self, name: str, *shape: int) -> Tensor:
        return take_weight(self.tensors, self.names, self.source, name, *shape)

    def _shared(self) -> Tensor:
        """The embedding (V, C): shared, or the stacks' copies, which must all agree."""
        stored = [name for name in ("shared.weight", "encoder.embed_tokens.weight",
                                    "decoder.embed_tokens.weight") if name in self.names]
        if not stored:
            raise ForeignCheckpointError(f"{self.source}: missing weight 'shared.weight'")
        first = self.take(stored[0], self.vocab_size, self.d_model)
        for name in stored[1:]:
            if not torch.equal(self.take(name, self.vocab_size, self.d_model), first):
                raise ForeignCheckpointError(f"{self.source}: {name!r} differs from "
                                             f"{stored[0]!r}; T5 embeds both sides with one "
                                             f"matrix")
        return first

    def untied_output(self) -> bool:
        """Whether lm_head is stored and is another matrix than the embedding."""
        if "lm_head.weight" not in self.names:
            return False
        stored = self.tensors[self.names["lm_head.weight"]]
        return tuple(stored.shape) != tuple(self.shared.shape) or \
            not torch.equal(stored.float(), self.shared)

    def state_dict(self, config: ModelConfig, vocabulary: MarianVocabulary,
                   scaled: bool) -> dict[str, Tensor]:
        """Our state dict (float32), in our ids' order: queries times sqrt(d_kv), the
        decoder's final gain times d_model^-0.5 where T5 scales its last states."""
        rows = torch.tensor(vocabulary.marian_ids)           # ours[i] = theirs[rows[i]]
        c = config.d_model
        embedding = self.shared[rows]
        state = {"encoder.embed.embedding.weight": embedding,
                 "decoder.embed.embedding.weight": embedding}
        if config.tie_embeddings == "embeddings":
            state["output_proj.weight"] = self.take("lm_head.weight", self.vocab_size, c)[rows]
        else:
            self.names.pop("lm_head.weight", None)           # equal to shared: checked
            state["output_proj.weight"] = embedding
        bias = torch.zeros(len(rows))
        bias[[PAD_ID, BOS_ID]] = NEVER_OUTPUT
        state["output_proj.bias"] = bias
        for stack, count in (("encoder", config.num_encoder_layers),
                             ("decoder", config.num_decoder_layers)):
            state[f"{stack}.score_bias.table.weight"] = self.take(
                f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                BUCKETS, config.num_heads)
            for i in range(count):
                state.update(self.block(config, stack, i))
            state[f"{stack}.final_norm.weight"] = self.take(f"{stack}.final_layer_norm.weight", c)
        if scaled:
            state["decoder.final_norm.weight"] = state["decoder.final_norm.weight"] * c ** -0.5
        refuse_unread(self.names, self.source, IGNORED)
        return state

    def block(self, config: ModelConfig, stack: str, i: int) -> dict[str, Tensor]:
        """One layer: self-attention, (the decoder's) cross-attention, feed-forward."""
        theirs, ours = f"{stack}.block.{i}.layer", f"{stack}.layers.{i}"
        state = {}
        for n, (name, attention, norm) in enumerate(SUBLAYERS[stack]):
            state.update(self.attention(config, f"{theirs}.{n}.{name}", f"{ours}.{attention}"))
            state[f"{ours}.{norm}.weight"] = self.take(f"{theirs}.{n}.layer_norm.weight",
                                                       config.d_model)
        n = len(SUBLAYERS[stack])
        state.update(self.feed_forward(config, f"{theirs}.{n}.DenseReluDense", f"{ours}.ffn"))
        state[f"{ours}.{FFN_NORM[stack]}.weight"] = self.take(f"{theirs}.{n}.layer_norm.weight",
                                                              config.d_model)
        return state

    def attention(self, config: ModelConfig, theirs: str, ours: str) -> dict[str, Tensor]:
        c, inner = config.d_model, config.num_heads * config.head_dim
        return {f"{ours}.q_proj.weight": self.take(f"{theirs}.q.weight", inner, c)
                * math.sqrt(config.head_dim),          # T5's scores are not scaled
                f"{ours}.k_proj.weight": self.take(f"{theirs}.k.weight", inner, c),
                f"{ours}.v_proj.weight": self.take(f"{theirs}.v.weight", inner, c),
                f"{ours}.out_proj.weight": self.take(f"{theirs}.o.weight", c, inner)}

    def feed_forward(self, config: ModelConfig, theirs: str, ours: str) -> dict[str, Tensor]:
        c, ff = config.d_model, config.d_ff
        if config.gated_ffn:        # act(x wi_0) * (x wi_1), then wo
            state = {f"{ours}.linear1.weight": self.take(f"{theirs}.wi_0.weight", ff, c),
                     f"{ours}.linear3.weight": self.take(f"{theirs}.wi_1.weight", ff, c)}
        else:
            state = {f"{ours}.linear1.weight": self.take(f"{theirs}.wi.weight", ff, c)}
        state[f"{ours}.linear2.weight"] = self.take(f"{theirs}.wo.weight", c, ff)
        return state
