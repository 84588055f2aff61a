"""Export to ONNX: an encoder-decoder's two phases of incremental decoding as two graphs
(a decoder-only model's one graph: export/onnx_decoder.py; an encoder-only model's:
export/onnx_encoder.py).

    encoder.onnx       src (B, S) int64 -> cross_k.{i}, cross_v.{i} (B, Hkv, S, D) for
                       every decoder layer i: the prefill's source side, once per source
    decoder_step.onnx  tokens (R, T) int64, row_source (R,) int64, src_mask (B, S) bool,
                       past_k.{i}, past_v.{i} (R, Hkv, P, D), cross_k.{i}, cross_v.{i}
                       (B, Hkv, S, D) -> logits (R, T, V), present_k.{i}, present_v.{i}
                       (R, Hkv, P + T, D)

Every size is dynamic: sources, source length, target rows (beams), past length (0 for
the first step) and step length. Target row r reads source row_source[r]: the sources'
keys and values are stored once and gathered per row inside the graph.

The exporter is the TorchScript tracer (`torch.onnx.export(dynamo=False)`) with dynamic
axes, chosen on purpose: torch.export specialises a dimension of size 0 or 1, and an
empty past (P = 0) and one-token steps (T = 1) are exactly those sizes, while the tracer
records shape arithmetic as graph operations whatever the example's sizes. What it
cannot keep symbolic is a size compared in Python, or one that unflatten infers: the
model's size checks and shortcuts step aside while tracing (torch.jit.is_tracing),
heads are split with sizes read from their input, the step's causal mask is built here
from the inputs' sizes, and the example takes the general path (two new tokens after a
non-empty past).
Attention is exported in its matrix-product form (`impl="naive"`), plain
MatMul/Softmax/Where operators every runtime has; GQA and MQA broadcast their key/value
heads inside it. T5's relative-position bias (an encoder-decoder's) is traced like the
causal mask: the distances, their buckets and the table's rows from the inputs' sizes.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from transduce import atomic, checkpoint
from transduce.attention.kv_cache import ConcatKVCache
from transduce.export.common import ExportError, not_a_plain_transformer
from transduce.export.onnx_decoder import export_language_model
from transduce.export.onnx_encoder import export_sentence_encoder
from transduce.export.onnx_files import has_weight_files, rewrite_graph, save_graph, \
    share_stored_weights, traced_graph
from transduce.export.onnx_int8_tables import quantize_tables
from transduce.model import DecoderOnly, EncoderOnly, Transformer, load_model
from transduce.onnx_format import DECODER_STEP, ENCODER, INFO, cache_names

OPSET = 17
ONNX_ARCHS = ("transformer", "decoder", "encoder")
QUANTIZATIONS = ("int8",)


def check_onnx_exportable(model: nn.Module) -> None:
    arch = model.config.arch
    problems = not_a_plain_transformer(model.config, arch if arch in ONNX_ARCHS else "transformer",
                                       # onnx_decoder's band; the encoder's: the
                                       # naive kernel's band (export_onnx)
                                       sliding=arch in ("decoder", "encoder"),
                                       mixed=arch == "encoder", modernbert=True,
                                       projected_embeddings=True,
                                       score_bias={"transformer": ("t5",),
                                                   "decoder": ("alibi",)}.get(arch, ()),
                                       any_head_size=arch in ("transformer", "decoder"),
                                       qk_norm=True, gemma=arch == "decoder",
                                       softcap=arch == "decoder", embedding_norm=True,
                                       neox=True, olmo2=True, phi=True,
                                       attention_bias=True, qk_norm_per_head=True)
    if arch not in ONNX_ARCHS:
        problems[0] = (f"arch={arch!r} (the export holds the Transformer's three shapes, "
                       f"arch {', '.join(map(repr, ONNX_ARCHS))})")
    if problems:
        raise ExportError("cannot export to ONNX: " + "; ".join(problems) + " (the export "
                          "writes softmax attention over scaled scores, and carries its "
                          "key/value cache between steps)")


class RMSNormOperators(nn.Module):
    """nn.RMSNorm as the operators opset 17 has (it has no RMSNormalization): x /
    sqrt(mean(x^2) + eps) * g, with the module's own gain."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight = norm.weight
        self.eps = torch.finfo(torch.float32).eps if norm.eps is None else norm.eps

    def forward(self, x: Tensor) -> Tensor:
        """(..., C) -> (..., C)."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _write_out_rms_norms(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.RMSNorm):
                setattr(parent, name, RMSNormOperators(child))


class EncoderGraph(nn.Module):
    """src (B, S) -> each decoder layer's cross-attention keys and values."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, src: Tensor) -> tuple[Tensor, ...]:
        memory = self.model.encode(src)                                   # (B, S, C)
        return tuple(t for kv in self.model.decoder.memory_kv(memory) for t in kv)


class DecoderStepGraph(nn.Module):
    """One decode step over a past given as inputs; the present returned as outputs."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model
        self.layers = model.config.num_decoder_layers

    def forward(self, tokens: Tensor, row_source: Tensor, src_mask: Tensor,
                *caches: Tensor) -> tuple[Tensor, ...]:
        """tokens (R, T), row_source (R,), src_mask (B, S), then past k/v per layer,
        then cross k/v per layer -> logits (R, T, V) and the present k/v per layer."""
        past, cross = caches[:2 * self.layers], caches[2 * self.layers:]
        # The causal mask from the inputs' sizes, which the trace keeps symbolic.
        past_len, steps = past[0].shape[2], tokens.shape[1]
        query_pos = torch.arange(steps, device=tokens.device)[:, None] + past_len
        key_pos = torch.arange(past_len + steps, device=tokens.device)[None, :]
        step_mask = (key_pos <= query_pos)[None, None]                    # (1, 1, T, P + T)
        self_caches = [ConcatKVCache(past[2 * i], past[2 * i + 1], step_mask)
                       for i in range(self.layers)]
        memory_kv = [(cross[2 * i].index_select(0, row_source),
                      cross[2 * i + 1].index_select(0, row_source)) for i in range(self.layers)]
        memory_mask = src_mask.index_select(0, row_source)[:, None, None, :]
        hidden = self.model.decoder(tokens, memory_kv, memory_mask, caches=self_caches)
        logits = self.model.output_proj(hidden)
        return (logits, *(t for cache in self_caches for t in (cache.k, cache.v)))


def export_onnx(path: Path, out: Path, quantize: str | None = None) -> Path:
    """Write OUT/encoder.onnx and OUT/decoder_step.onnx (a language model: OUT/decoder.onnx;
    an encoder-only one: OUT/sentence_encoder.onnx), config.json and the tokenizer.
    quantize "int8": weights int8 (onnxruntime's dynamic quantization)."""
    import onnx

    if quantize not in (None, *QUANTIZATIONS):
        raise ExportError(f"quantize={quantize!r}: choose one of {', '.join(QUANTIZATIONS)}")
    directory = checkpoint.resolve(path)
    model = load_model(directory).eval()
    check_onnx_exportable(model)
    for module in model.modules():      # the matrix-product form of attention
        if hasattr(module, "impl"):
            module.impl = "naive"
    _write_out_rms_norms(model)
    with atomic.atomic_directory(out) as temporary:
        if isinstance(model, DecoderOnly):
            graphs = export_language_model(model, temporary, OPSET)
        elif isinstance(model, EncoderOnly):
            graphs = export_sentence_encoder(model, temporary, OPSET)
        else:
            graphs = _export_encoder_decoder(model, temporary)
        for name in graphs:
            onnx.checker.check_model(str(temporary / name), full_check=True)
        tied: set[str] = set()
        if quantize == "int8":    # the step's tied table first, then the encoder's copy
            for name in sorted(graphs, key=lambda name: name == ENCODER):
                tied |= _quantize_int8(temporary / name, tied)
        if graphs == [ENCODER, DECODER_STEP]:    # the tied embedding, stored once
            share_stored_weights(temporary / ENCODER, temporary / DECODER_STEP)
        for name in (checkpoint.CONFIG, checkpoint.TOKENIZER, checkpoint.TARGET_TOKENIZER,
                     checkpoint.TOKENIZER_JSON):
            if (directory / name).is_file():
                shutil.copyfile(directory / name, temporary / name)
        (temporary / INFO).write_text(json.dumps(
            {"opset": OPSET, "quantize": quantize, "graphs": graphs},
            indent=2) + "\n", encoding="utf-8")
    return out


def _export_encoder_decoder(model: Transformer, out: Path) -> list[str]:
    c = model.config
    layers, heads, dim = c.num_decoder_layers, c.kv_heads, c.head_dim
    sources, beams, source_len, past_len, step_len = 2, 2, 5, 3, 2
    src = torch.randint(4, c.src_vocab_size, (sources, source_len))
    src[1, 3:] = c.pad_id
    rows = sources * beams
    past = [torch.randn(rows, heads, past_len, dim) for _ in range(2 * layers)]
    with torch.no_grad():
        cross = list(EncoderGraph(model)(src))
    tokens = torch.randint(4, c.tgt_vocab_size, (rows, step_len))
    row_source = torch.arange(sources).repeat_interleave(beams)
    src_mask = src != c.pad_id
    cross_names, past_names = cache_names(layers, "cross"), cache_names(layers, "past")
    present_names = cache_names(layers, "present")
    source_axes = {0: "sources", 2: "source_length"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # tracer notes on size checks taken at trace time
        with traced_graph(out / ENCODER) as path:
            torch.onnx.export(EncoderGraph(model), (src,), str(path), dynamo=False,
                              input_names=["src"], output_names=cross_names,
                              opset_version=OPSET,
                              dynamic_axes={"src": {0: "sources", 1: "source_length"},
                                            **{name: source_axes for name in cross_names}})
        with traced_graph(out / DECODER_STEP) as path:
            torch.onnx.export(
                DecoderStepGraph(model), (tokens, row_source, src_mask, *past, *cross),
                str(path), dynamo=False, opset_version=OPSET,
                input_names=["tokens", "row_source", "src_mask", *past_names, *cross_names],
                output_names=["logits", *present_names],
                dynamic_axes={"tokens": {0: "rows", 1: "step_length"}, "row_source": {0: "rows"},
                              "src_mask": {0: "sources", 1: "source_length"},
                              "logits": {0: "rows", 1: "step_length"},
                              **{name: {0: "rows", 2: "past_length"} for name in past_names},
                              **{name: {0: "rows", 2: "present_length"} for name in present_names},
                              **{name: source_axes for name in cross_names}})
    return [ENCODER, DECODER_STEP]


def _quantize_int8(graph: Path, tied_elsewhere: set[str]) -> set[str]:
    """Linear and MatMul weights to int8 per channel, activations quantized per call; a
    tied table once for its embedding and product (onnx_int8_tables) -> the tied tables'
    digests. Weights take 7 bits (reduce_range): ONNX Runtime multiplies u8 x s8 in pairs
    summed in int16 on CPUs without VNNI (AVX2), where 255 x 127 x 2 saturates (35% off
    on an AVX2-only EPYC) and 255 x 63 x 2 does not; an export runs on any CPU."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(graph))
    ours, tied = quantize_tables(model, tied_elsewhere)
    save_graph(model, graph)
    del model
    quantized = graph.with_suffix(".int8.onnx")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)   # its advice on pre-processing is for image models
    try:
        quantize_dynamic(str(graph), str(quantized), weight_type=QuantType.QInt8,
                         per_channel=True, reduce_range=True, nodes_to_exclude=ours,
                         use_external_data_format=has_weight_files(graph))
    finally:
        root.setLevel(level)
    rewrite_graph(quantized, graph)      # (its weights inside it, or in GRAPH.data)
    return tied
