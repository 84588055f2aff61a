"""Hugging Face Marian (MarianMTModel directories: the OPUS-MT translation models) -> our
Transformer.

Marian is the paper's encoder-decoder: post-norm layers, sinusoidal positions from 0,
token embeddings scaled by sqrt(d_model) (scale_embedding), one vocabulary whose matrix
the source and target embeddings and the output share, or (share_encoder_decoder_embeddings
false) an encoder's matrix of its own, over a separate source vocabulary where the
tokenizer has one (separate_vocabs: vocab.json and source.spm for the sources,
target_vocab.json and target.spm for the targets; our spm.model and spm-target.model,
tie_embeddings "decoder"). Three things differ:

- the position table puts all its sines first and all its cosines second, where ours
  interleaves them; every weight that touches the residual stream is permuted back
  (the inverse of our Marian export's permutation, export/hf.py), which LayerNorm,
  attention and the feed-forward network are equivariant to;
- the output adds final_logits_bias (output_bias=True here), and transformers' search
  never outputs <pad> (MarianMTModel sets its logit to -inf, as bad_words_ids asks):
  the imported bias is NEVER_OUTPUT (-2^100) for pad, bos and every
  single-token bad word, a probability of 0 as -inf would give, which a checkpoint's
  weights cannot hold (a weight that is not finite marks a diverged run);
- the ids: ours put pad, bos, eos, unk first (marian_vocabulary.py), so the embedding
  rows and the bias are reordered; bos takes the row of the decoder's start token;
  target.spm, where it segments otherwise, is kept beside ours as spm-target.model, the
  segmentation of the references a fine-tuning run trains on.

    shared / encoder.embed_tokens / decoder.embed_tokens   (tied) the embedding
    encoder.layers.N.self_attn.{q,k,v,out}_proj     encoder.layers.N.self_attn.*
    encoder.layers.N.self_attn_layer_norm           encoder.layers.N.norm1
    encoder.layers.N.fc1, fc2, final_layer_norm     .ffn.linear1, .ffn.linear2, .norm2
    decoder.layers.N.self_attn(_layer_norm)         decoder.layers.N.self_attn, .norm1
    decoder.layers.N.encoder_attn(_layer_norm)      decoder.layers.N.cross_attn, .norm2
    decoder.layers.N.fc1, fc2, final_layer_norm     .ffn.linear1, .ffn.linear2, .norm3

Keys may carry the "model." prefix (MarianMTModel) or not (MarianModel). Every key is
accounted for: stored position tables must be the sinusoids, a stored lm_head must equal
the (decoder's) embedding, and anything else, or anything missing, is an error naming
the key.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from transduce import checkpoint
from transduce.config import ConfigError, ModelConfig
from transduce.data.tokenizer import BOS_ID, PAD_ID
from transduce.importers import ForeignCheckpointError, check_directories, \
    check_foreign_options, refuse_unread, take_weight, unprefixed_names
from transduce.importers.hf_gpt2 import HF_CONFIG, _read_json, read_weights, tokenizer_settings
from transduce.importers.marian_vocabulary import BOS_NAMES, MarianVocabulary, \
    merged_vocabulary
from transduce.model import empty_model
from transduce.model.positional import sinusoidal_table, sines_first_permutation
from transduce.model.transformer import NEVER_OUTPUT, Transformer

SOURCE_SPM, TARGET_SPM, VOCAB_JSON = "source.spm", "target.spm", "vocab.json"
TARGET_VOCAB_JSON = "target_vocab.json"      # separate_vocabs: the targets' vocab.json
GENERATION_CONFIG = "generation_config.json"
# transformers' activation names -> ModelConfig.activation (OPUS-MT's are "swish").
ACTIVATIONS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu",
               "gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh"}
# Options whose other value changes what the model computes: name -> the value we have
# (the first four are Marian-NMT's, kept in old configs; transformers assumes them). Old
# configs' add_bias_logits is not among them: transformers adds final_logits_bias anyway.
FIXED_OPTIONS = {"normalize_before": False, "add_final_layer_norm": False,
                 "normalize_embedding": False, "static_position_embeddings": True,
                 "tie_word_embeddings": True, "is_encoder_decoder": True}
EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight",
              "decoder.embed_tokens.weight", "lm_head.weight")
POSITIONS = ("encoder.embed_positions.weight", "decoder.embed_positions.weight")
POSITION_TOLERANCE = 1e-4      # float32 tables computed two ways; a float16 one is rounded


def import_marian(hf_dir: Path | str, out: Path | str) -> Path:
    """Read a Hugging Face Marian directory (config.json, model.safetensors or
    pytorch_model.bin, source.spm, vocab.json, tokenizer_config.json) and write it as
    our checkpoint at `out`, replacing one there; nothing is written unless everything
    was read and checked. The source and target languages of tokenizer_config.json
    (source_lang, target_lang), when it names both, are recorded as the model's."""
    hf_dir, out = Path(hf_dir), Path(out)
    hf, config_file, activation = read_bart_config(hf_dir, out, "marian", FIXED_OPTIONS,
                                                   "gelu")
    shared = hf.get("share_encoder_decoder_embeddings", True)
    if not isinstance(shared, bool):
        raise ForeignCheckpointError(f"{config_file}: share_encoder_decoder_embeddings="
                                     f"{shared!r}; expected true or false")
    vocabulary, target, languages = read_vocabulary(hf_dir, hf)
    config = model_config(hf, config_file, activation, len(vocabulary.marian_ids),
                          len(target.marian_ids) if target else None, shared=shared)
    tensors, source = read_weights(hf_dir)
    model = empty_model(config)     # every weight is loaded next
    banned = bad_words(hf, hf_dir / GENERATION_CONFIG)
    sizes = (hf["vocab_size"], hf.get("decoder_vocab_size") or hf["vocab_size"])
    model.load_state_dict(map_weights(tensors, config, sizes, banned, vocabulary, target,
                                      source))
    del tensors          # the stored files are let go before the save copies the model
    model.languages = languages
    return save_with_vocabulary(out, model, vocabulary, "hf-marian", hf_dir, target)


def save_with_vocabulary(out: Path, model: Transformer, vocabulary: MarianVocabulary,
                         imported: str, hf_dir: Path,
                         target: MarianVocabulary | None = None) -> Path:
    """The imported model as our checkpoint at `out`, with the merged SentencePiece
    model, and beside it the targets' (checkpoint.py): a separate vocabulary's
    (`target`), or the same pieces where target.spm segments otherwise."""
    origin = {"imported": imported, "from": str(hf_dir.resolve()), "steps": None,
              "source_pieces_not_in_vocabulary": vocabulary.dropped}
    target_model = vocabulary.target_model if target is None else target.model
    with tempfile.TemporaryDirectory(prefix="transduce-import-") as scratch:
        spm_file = Path(scratch) / checkpoint.TOKENIZER
        spm_file.write_bytes(vocabulary.model)
        if target_model is not None:
            (Path(scratch) / checkpoint.TARGET_TOKENIZER).write_bytes(target_model)
        return checkpoint.save(out, model.eval(), None, spm_file, origin=origin)


def read_bart_config(hf_dir: Path, out: Path, model_type: str, fixed: dict[str, Any],
                     default_activation: str) -> tuple[dict[str, Any], Path, str]:
    """The directories checked, config.json read, its `fixed` options checked -> (its
    values, its path, our name of its activation)."""
    check_directories(hf_dir, out, HF_CONFIG)
    config_file = hf_dir / HF_CONFIG
    hf = _read_json(config_file)
    activation = check_foreign_options(hf, config_file, model_type, fixed,
                                       "activation_function", default_activation,
                                       ACTIVATIONS)
    return hf, config_file, activation


def read_vocabulary(hf_dir: Path, hf: dict[str, Any]) -> tuple[
        MarianVocabulary, MarianVocabulary | None, tuple[str, str] | None]:
    """The merged SentencePiece vocabulary, with target.spm's segmentation if there is
    one (marian_vocabulary.py), the separate target vocabulary (separate_vocabs; else
    None), and the (source, target) languages tokenizer_config.json names."""
    specials, options = tokenizer_settings(
        hf_dir, {"eos": "</s>", "unk": "<unk>", "pad": "<pad>"},
        ("separate_vocabs", "source_lang", "target_lang"))
    separate = options.get("separate_vocabs") is True
    vocab, target_vocab = _read_vocab_files(hf_dir, hf, specials, separate)
    start = hf.get("decoder_start_token_id")
    start = target_vocab[specials["pad"]] if start is None else start   # transformers' default
    if not isinstance(start, int) or start not in set(target_vocab.values()):
        raise ForeignCheckpointError(f"{hf_dir / HF_CONFIG}: decoder_start_token_id={start!r} "
                                     f"is not an id of "
                                     f"{TARGET_VOCAB_JSON if separate else VOCAB_JSON}")
    source_spm, target_spm = hf_dir / SOURCE_SPM, hf_dir / TARGET_SPM
    if separate:
        vocabulary = merged_vocabulary(source_spm, None, vocab, **specials,
                                       decoder_start=_source_bos(vocab, specials["pad"]))
        target = merged_vocabulary(target_spm, None, target_vocab, **specials,
                                   decoder_start=start)
    else:       # target.spm: another segmentation of the same pieces, if there is one
        vocabulary = merged_vocabulary(source_spm, target_spm if target_spm.is_file() else None,
                                       vocab, **specials, decoder_start=start)
        target = None
    source_lang, target_lang = options.get("source_lang"), options.get("target_lang")
    languages = (source_lang, target_lang) \
        if isinstance(source_lang, str) and isinstance(target_lang, str) else None
    return vocabulary, target, languages


def _read_vocab_files(hf_dir: Path, hf: dict[str, Any], specials: dict[str, str],
                      separate: bool) -> tuple[dict[str, int], dict[str, int]]:
    """vocab.json, and target_vocab.json where the vocabularies are separate (else
    vocab.json again), checked against the config."""
    if separate and hf.get("share_encoder_decoder_embeddings", True) is not False:
        raise ForeignCheckpointError(f"{hf_dir / HF_CONFIG}: separate_vocabs=true needs "
                                     f"share_encoder_decoder_embeddings=false (a matrix for "
                                     f"each vocabulary)")
    needed = (SOURCE_SPM, VOCAB_JSON) + ((TARGET_SPM, TARGET_VOCAB_JSON) if separate else ())
    for name in needed:
        if not (hf_dir / name).is_file():
            raise ForeignCheckpointError(f"{hf_dir}: no {name} (a Marian tokenizer has "
                                         f"{SOURCE_SPM}, {TARGET_SPM} and {VOCAB_JSON}"
                                         f"{f', and {TARGET_VOCAB_JSON}' if separate else ''})")
    # Separate vocabularies each end with a <pad> of their own: pad_token_id names one.
    config_ids = ("eos",) if separate else ("eos", "pad")
    vocab = _read_json(hf_dir / VOCAB_JSON)
    check_vocab(vocab, hf, hf_dir / VOCAB_JSON, hf_dir / HF_CONFIG, specials,
                config_ids=config_ids)
    decoder_size = hf.get("decoder_vocab_size")
    if not separate:
        if decoder_size not in (None, hf["vocab_size"]):
            raise ForeignCheckpointError(f"{hf_dir / HF_CONFIG}: decoder_vocab_size="
                                         f"{decoder_size} differs from vocab_size="
                                         f"{hf['vocab_size']}, but the tokenizer has one "
                                         f"vocabulary (no separate_vocabs)")
        return vocab, vocab
    target_vocab = _read_json(hf_dir / TARGET_VOCAB_JSON)
    check_vocab(target_vocab, hf, hf_dir / TARGET_VOCAB_JSON, hf_dir / HF_CONFIG, specials,
                "decoder_vocab_size", config_ids)
    return vocab, target_vocab


def _source_bos(vocab: dict[str, int], pad: str) -> int:
    """The id a separate source vocabulary's bos (which sources never hold) takes: its
    bos piece's (one our exports wrote), else pad's."""
    return next((vocab[name] for name in BOS_NAMES if name in vocab), vocab[pad])


def check_vocab(vocab: Any, hf: dict[str, Any], vocab_file: Path, config_file: Path,
                specials: dict[str, str], size_key: str = "vocab_size",
                config_ids: tuple[str, ...] = ("eos", "pad")) -> None:
    """vocab.json (or target_vocab.json, of decoder_vocab_size ids) maps pieces to
    distinct ids below the config's size, with the special pieces, and the config's ids
    of `config_ids` are theirs."""
    if not isinstance(vocab, dict) or not vocab or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
        raise ForeignCheckpointError(f"{vocab_file}: not a mapping of pieces to ids")
    size = hf.get(size_key)
    if not isinstance(size, int) or size < 1:
        raise ForeignCheckpointError(f"{config_file}: {size_key}={size!r}")
    ids = list(vocab.values())
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= size:
        raise ForeignCheckpointError(f"{vocab_file}: ids must be distinct and from 0 to "
                                     f"{size_key} - 1 = {size - 1}")
    for role, piece in specials.items():
        if piece not in vocab:
            raise ForeignCheckpointError(f"{vocab_file}: no {role} piece {piece!r}")
        given = hf.get(f"{role}_token_id")
        if role in config_ids and given is not None and given != vocab[piece]:
            raise ForeignCheckpointError(f"{config_file}: {role}_token_id={given} but "
                                         f"{piece!r} is {vocab[piece]} in {vocab_file.name}")


def model_config(hf: dict[str, Any], config_file: Path, activation: str, vocab_size: int,
                 target_size: int | None = None, *, shared: bool = True,
                 norm_first: bool = False, positional: str = "sinusoidal") -> ModelConfig:
    """Our ModelConfig of a Marian configuration (or of the same keys: M2M100's, which is
    norm_first with its positions as a learned table), target_size ids for a separate
    target vocabulary, shared=False for an encoder's embedding of its own; what differs
    between the stacks, or what we cannot reproduce, is refused."""
    def required(name: str) -> Any:
        if name not in hf:
            raise ForeignCheckpointError(f"{config_file}: no {name!r}")
        return hf[name]

    for ours, (encoder_key, decoder_key) in {
            "num_heads": ("encoder_attention_heads", "decoder_attention_heads"),
            "d_ff": ("encoder_ffn_dim", "decoder_ffn_dim")}.items():
        if required(encoder_key) != required(decoder_key):
            raise ForeignCheckpointError(f"{config_file}: {encoder_key}={hf[encoder_key]} "
                                         f"but {decoder_key}={hf[decoder_key]}; our stacks "
                                         f"share {ours}")
    if not isinstance(required("d_model"), int) or hf["d_model"] % 2:
        raise ForeignCheckpointError(f"{config_file}: d_model={hf['d_model']!r}; the "
                                     f"sinusoids need an even size")
    try:
        return ModelConfig(
            src_vocab_size=vocab_size, tgt_vocab_size=target_size or vocab_size,
            d_model=required("d_model"),
            num_heads=hf["encoder_attention_heads"], d_ff=hf["encoder_ffn_dim"],
            num_encoder_layers=required("encoder_layers"),
            num_decoder_layers=required("decoder_layers"),
            dropout=hf.get("dropout", 0.1), attention_dropout=hf.get("attention_dropout", 0.0),
            activation=activation, norm_first=norm_first, positional=positional,
            max_positions=required("max_position_embeddings"),
            tie_embeddings="all" if shared else "decoder",
            bias=True, layer_norm_eps=1e-5, pad_id=PAD_ID,
            scale_embeddings=bool(hf.get("scale_embedding", False)), output_bias=True)
    except (ConfigError, TypeError) as error:
        raise ForeignCheckpointError(f"{config_file}: {error}") from None


def bad_words(hf: dict[str, Any], generation_config: Path) -> set[int]:
    """The Marian ids that bad_words_ids (of config.json, or of generation_config.json,
    where newer transformers keep it) bans on their own: never output."""
    found = [hf.get("bad_words_ids")]
    if generation_config.is_file():
        found.append(_read_json(generation_config).get("bad_words_ids"))
    return {words[0] for lists in found if isinstance(lists, list) for words in lists
            if isinstance(words, list) and len(words) == 1 and isinstance(words[0], int)}


def map_weights(tensors: dict[str, Tensor], config: ModelConfig, sizes: tuple[int, int],
                banned: set[int], vocabulary: MarianVocabulary,
                target: MarianVocabulary | None, source: Path) -> dict[str, Tensor]:
    """Marian's tensors (vocabularies of sizes: the encoder's, the decoder's) -> our
    state dict (float32): the model dimension permuted back to interleaved sines, the
    vocabulary (and a separate target one) reordered to ours, the `banned` Marian ids
    never output, each key accounted for."""
    weights = BartWeights(tensors, source, config.d_model)
    take_bart_weights(weights, config, sizes[0], banned, vocabulary, target=target,
                      decoder_size=sizes[1])
    _check_positions(weights, config)
    return weights.all_taken()


def take_bart_weights(weights: "BartWeights", config: ModelConfig, stored_size: int,
                      banned: set[int], vocabulary: MarianVocabulary,
                      final_norms: bool = False, *, target: MarianVocabulary | None = None,
                      decoder_size: int | None = None) -> None:
    """The embeddings in our ids' order (shared, or the encoder's and the decoder's where
    config ties the decoder's alone: over `target`'s ids where it is separate, of
    decoder_size stored rows), the output bias (the `banned` stored ids never output)
    and every layer into weights.state; with final_norms, each stack's last LayerNorm
    too (pre-norm's: M2M100's layer_norm)."""
    rows = torch.tensor(vocabulary.marian_ids)            # ours[i] = theirs[rows[i]]
    target_rows = rows if target is None else torch.tensor(target.marian_ids)
    decoder_size = decoder_size or stored_size
    if config.tie_embeddings == "all":
        embedding = weights.permute(stored_embedding(weights, stored_size)[rows], 1)
        weights.state["encoder.embed.embedding.weight"] = embedding
    else:
        encoder = stored_embedding(weights, stored_size, EMBEDDINGS[1:2])
        weights.state["encoder.embed.embedding.weight"] = weights.permute(encoder[rows], 1)
        embedding = weights.permute(
            stored_embedding(weights, decoder_size, EMBEDDINGS[2:])[target_rows], 1)
    for key in ("decoder.embed.embedding.weight", "output_proj.weight"):
        weights.state[key] = embedding
    weights.state["output_proj.bias"] = output_bias(weights, banned, target_rows, decoder_size)
    for stack, layers in (("encoder", config.num_encoder_layers),
                          ("decoder", config.num_decoder_layers)):
        for i in range(layers):
            weights.layer(f"{stack}.layers.{i}", config.d_ff, cross=stack == "decoder")
        if final_norms:
            weights.norm(f"{stack}.final_norm", f"{stack}.layer_norm")


class BartWeights:
    """The stored tensors of BART's layout (Marian's, M2M100's), each read once into
    our state dict; with `permuted`, Marian's, the model dimension is permuted back:
    ours = theirs[order] along it (else order is None, and nothing is copied)."""

    def __init__(self, tensors: dict[str, Tensor], source: Path, d_model: int,
                 permuted: bool = True):
        self.tensors, self.source, self.d_model = tensors, source, d_model
        self.names = unprefixed_names(tensors, "model.", source)   # what is left to read
        self.order = sines_first_permutation(d_model).argsort() if permuted else None
        self.state: dict[str, Tensor] = {}

    def permute(self, tensor: Tensor, dim: int = 0) -> Tensor:
        """tensor with the model dimension `dim` in our order."""
        return tensor if self.order is None else tensor.index_select(dim, self.order)

    def take(self, name: str, *shape: int) -> Tensor:
        return take_weight(self.tensors, self.names, self.source, name, *shape)

    def linear(self, ours: str, theirs: str, n_in: int, n_out: int, writes: bool) -> None:
        """A projection that reads the residual stream (fc1, q, k, v: its input is
        permuted) or writes it (writes: fc2, out_proj: its output is)."""
        weight = self.take(f"{theirs}.weight", n_out, n_in)
        bias = self.take(f"{theirs}.bias", n_out)
        if writes:
            weight, bias = self.permute(weight), self.permute(bias)
        else:
            weight = self.permute(weight, 1)
        self.state[f"{ours}.weight"], self.state[f"{ours}.bias"] = weight, bias

    def norm(self, ours: str, theirs: str) -> None:
        for part in ("weight", "bias"):
            self.state[f"{ours}.{part}"] = self.permute(self.take(f"{theirs}.{part}",
                                                                 self.d_model))

    def attention(self, ours: str, theirs: str) -> None:
        c = self.d_model
        for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
            self.linear(f"{ours}.{projection}", f"{theirs}.{projection}", c, c,
                        writes=projection == "out_proj")

    def layer(self, prefix: str, d_ff: int, cross: bool) -> None:
        """Encoder layer `prefix` (encoder.layers.N), or a decoder layer (cross)."""
        c = self.d_model
        self.attention(f"{prefix}.self_attn", f"{prefix}.self_attn")
        self.norm(f"{prefix}.norm1", f"{prefix}.self_attn_layer_norm")
        self.linear(f"{prefix}.ffn.linear1", f"{prefix}.fc1", c, d_ff, writes=False)
        self.linear(f"{prefix}.ffn.linear2", f"{prefix}.fc2", d_ff, c, writes=True)
        if cross:
            self.attention(f"{prefix}.cross_attn", f"{prefix}.encoder_attn")
            self.norm(f"{prefix}.norm2", f"{prefix}.encoder_attn_layer_norm")
        self.norm(f"{prefix}.norm3" if cross else f"{prefix}.norm2",
                  f"{prefix}.final_layer_norm")

    def all_taken(self) -> dict[str, Tensor]:
        """The state dict, once every stored tensor was read (else the first unread is
        named)."""
        refuse_unread(self.names, self.source)
        return {name: tensor.contiguous() for name, tensor in self.state.items()}


def stored_embedding(weights: BartWeights, vocab_size: int,
                     names: tuple[str, ...] = EMBEDDINGS) -> Tensor:
    """An embedding (V, C) as stored under `names` (default: the shared one's): every
    stored copy (shared, the stacks', lm_head) must be the same matrix."""
    stored = [name for name in names if name in weights.names]
    if not stored:
        raise ForeignCheckpointError(f"{weights.source}: missing weight {names[0]!r}")
    first = weights.take(stored[0], vocab_size, weights.d_model)
    for name in stored[1:]:
        if not torch.equal(weights.take(name, vocab_size, weights.d_model), first):
            raise ForeignCheckpointError(f"{weights.source}: {name!r} differs from "
                                         f"{stored[0]!r}; the model ties them (one "
                                         f"matrix)")
    return first


def output_bias(weights: BartWeights, banned: set[int], rows: Tensor, vocab_size: int) -> Tensor:
    """final_logits_bias in our order (zeros when not stored), NEVER_OUTPUT for pad, bos and
    the `banned` Marian ids."""
    if "final_logits_bias" in weights.names:
        bias = weights.take("final_logits_bias", 1, vocab_size)[0]
    else:
        bias = torch.zeros(vocab_size)
    ours = bias[rows].clone()
    never = [i for i, marian_id in enumerate(rows.tolist()) if marian_id in banned]
    ours[[PAD_ID, BOS_ID] + never] = NEVER_OUTPUT
    return ours


def _check_positions(weights: BartWeights, config: ModelConfig) -> None:
    """Stored position tables (transformers saves them) must hold the sinusoids, sines
    first, that our model computes."""
    expected = sinusoidal_table(config.max_positions, config.d_model)[
        :, sines_first_permutation(config.d_model)]
    for name in POSITIONS:
        if name in weights.names:
            stored = weights.tensors[weights.names[name]].dtype     # (the converter's float16)
            tolerance = max(POSITION_TOLERANCE, torch.finfo(stored).eps) \
                if stored.is_floating_point else POSITION_TOLERANCE
            table = weights.take(name, config.max_positions, config.d_model)
            if not torch.allclose(table, expected, atol=tolerance, rtol=0):
                raise ForeignCheckpointError(f"{weights.source}: {name!r} is not the "
                                             f"sinusoidal table Marian computes")
