"""Where our LoRA adapters sit in Hugging Face's models, as PEFT names them: each of a
language model's adapted layers is a module of LlamaForCausalLM (Mistral's and Qwen2's
names are Llama's) or of GPT2LMHeadModel, whose c_attn holds q, k and v in one Conv1D;
an encoder's, a module of BERT's or RoBERTa's layers (bert. or roberta. before
encoder.layer.N.attention.self.query, .key, .value, attention.output.dense,
intermediate.dense, output.dense).

    ours (decoder.layers.N.)  Llama (model.layers.N.)   GPT-2 (transformer.h.N.)
    self_attn.q_proj          self_attn.q_proj          attn.c_attn, its first third
    self_attn.out_proj        self_attn.o_proj          attn.c_proj
    ffn.linear1               mlp.gate_proj             mlp.c_fc
    ffn.linear3               mlp.up_proj               -
    ffn.linear2               mlp.down_proj             mlp.c_proj

An adapter's matrices keep their shapes in either (A (r, in), B (out, r), a Conv1D's
weight being the transpose of ours); PEFT's file names them
"base_model.model.<module>.lora_A.weight" and "...lora_B.weight".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from transduce.config import ModelConfig

PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(self_attn\.[qkv]_proj|"
                    r"self_attn\.out_proj|ffn\.linear[123])$")
LLAMA_NAMES = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.k_proj",
               "self_attn.v_proj": "self_attn.v_proj", "self_attn.out_proj": "self_attn.o_proj",
               "ffn.linear1": "mlp.gate_proj", "ffn.linear3": "mlp.up_proj",
               "ffn.linear2": "mlp.down_proj"}
GPT2_NAMES = {"self_attn.out_proj": "attn.c_proj", "ffn.linear1": "mlp.c_fc",
              "ffn.linear2": "mlp.c_proj"}
GPT2_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")   # c_attn's parts
BERT_NAMES = {"self_attn.q_proj": "attention.self.query", "self_attn.k_proj": "attention.self.key",
              "self_attn.v_proj": "attention.self.value",
              "self_attn.out_proj": "attention.output.dense", "ffn.linear1": "intermediate.dense",
              "ffn.linear2": "output.dense"}


@dataclass(frozen=True)
class Place:
    """A Hugging Face module, and which of its output parts one of our layers is (GPT-2's
    c_attn: q, k, v in that order; every other module is one part, 0)."""

    module: str
    part: int = 0


def is_gpt2_layout(config: ModelConfig) -> bool:
    """Our language models export as GPT-2 without rotary positions, as Llama with them."""
    return config.positional != "rotary"


def encoder_prefix(config: ModelConfig) -> str:
    """Our encoders export as RoBERTa with one segment type, as BERT with more."""
    return "roberta." if config.type_vocab_size == 1 else "bert."


def place_of(config: ModelConfig, layer: str) -> Place:
    """Our adapted layer's name -> its place in the Hugging Face model; ValueError for a
    layer that has none (not a layer's attention or feed-forward matrix)."""
    found = _LAYER.match(layer)
    if found is None:
        raise ValueError(f"{layer}: not a layer's attention or feed-forward matrix")
    stack, index, ours = found.groups()
    if stack == "encoder":
        if ours not in BERT_NAMES:
            raise ValueError(f"{layer}: BERT's feed-forward network has no third matrix")
        return Place(f"{encoder_prefix(config)}encoder.layer.{index}.{BERT_NAMES[ours]}")
    if not is_gpt2_layout(config):
        return Place(f"model.layers.{index}.{LLAMA_NAMES[ours]}")
    if ours in GPT2_QKV:
        return Place(f"transformer.h.{index}.attn.c_attn", GPT2_QKV.index(ours))
    if ours not in GPT2_NAMES:
        raise ValueError(f"{layer}: GPT-2's feed-forward network has no third matrix")
    return Place(f"transformer.h.{index}.{GPT2_NAMES[ours]}")


def qkv_sizes(config: ModelConfig) -> tuple[int, int, int]:
    """The output sizes of c_attn's parts: q, k, v."""
    kv = config.kv_heads * config.head_dim
    return config.num_heads * config.head_dim, kv, kv
