"""`transduce import hf-gpt2` / `hf-bloom` / `hf-gpt-neox` / `hf-stablelm` / `hf-olmo2` /
`hf-phi` / `hf-gptj` (also called `hf-codegen`) / `hf-llama` / `hf-gemma` / `hf-bert` /
`hf-roberta` (also called `hf-xlm-roberta`) / `hf-distilbert` / `hf-electra` /
`hf-modernbert` / `hf-deberta` / `hf-marian` / `hf-nllb` (also called `hf-m2m100`) /
`hf-mbart` / `hf-t5`: another toolkit's checkpoint as ours;
`peft`: a PEFT LoRA adapter merged into one of ours."""

from __future__ import annotations

import argparse
from pathlib import Path

from transduce.cli.outputs import FORCE_HELP, check_output_directory


def register(commands) -> None:
    imports = commands.add_parser("import", help="read another toolkit's checkpoint into a "
                                                 "checkpoint of ours")
    formats = imports.add_subparsers(dest="format", required=True)
    _add_format(formats, import_hf_gpt2, "hf-gpt2",
                "Hugging Face GPT-2 (GPT2LMHeadModel directory)",
                "Import a Hugging Face GPT-2 directory (config.json, model.safetensors or "
                "pytorch_model.bin, tokenizer.json or vocab.json + merges.txt) as a "
                "decoder-only checkpoint; options the model cannot reproduce are refused by "
                "name.")
    _add_format(formats, import_hf_bloom, "hf-bloom",
                "Hugging Face BLOOM or BLOOMZ (BloomForCausalLM directory)",
                "Import a Hugging Face BLOOM directory (config.json, model.safetensors, its "
                "shards or pytorch_model.bin, tokenizer.json) as a decoder-only checkpoint "
                "(ALiBi, a LayerNorm of the embeddings); options the model cannot reproduce "
                "are refused by name.")
    _add_format(formats, import_hf_gpt_neox, "hf-gpt-neox",
                "Hugging Face GPT-NeoX: Pythia, GPT-NeoX-20B, RedPajama-INCITE, Dolly v2 "
                "(GPTNeoXForCausalLM directory)",
                "Import a Hugging Face GPT-NeoX directory (config.json, model.safetensors, "
                "its shards or pytorch_model.bin, tokenizer.json) as a decoder-only "
                "checkpoint (parallel residuals, rotary positions on part of each head); "
                "options the model cannot reproduce are refused by name.")
    _add_format(formats, import_hf_stablelm, "hf-stablelm",
                "Hugging Face StableLM: stablelm-2-1_6b, stablelm-2-12b, stablelm-3b-4e1t, "
                "their chat twins (StableLmForCausalLM directory)",
                "Import a Hugging Face StableLM directory (config.json, model.safetensors, "
                "its shards or pytorch_model.bin, tokenizer.json) as a decoder-only "
                "checkpoint (LayerNorms, SwiGLU, rotary positions on part of each head; "
                "the 12B's parallel layers and norms of each head's queries and keys); "
                "options the model cannot reproduce are refused by name.")
    _add_format(formats, import_hf_olmo2, "hf-olmo2",
                "Hugging Face OLMo 2: OLMo-2 1B to 32B and their Instruct twins "
                "(Olmo2ForCausalLM directory)",
                "Import a Hugging Face OLMo 2 directory (config.json, model.safetensors, "
                "its shards or pytorch_model.bin, tokenizer.json) as a decoder-only "
                "checkpoint (norms on the sub-layers' outputs alone, queries and keys "
                "normalized over all heads); options the model cannot reproduce are "
                "refused by name.")
    _add_format(formats, import_hf_phi, "hf-phi",
                "Hugging Face Phi: phi-1, phi-1_5, phi-2 (PhiForCausalLM directory)",
                "Import a Hugging Face Phi directory (config.json, model.safetensors, its "
                "shards or pytorch_model.bin, tokenizer.json) as a decoder-only checkpoint "
                "(parallel residuals over one norm, rotary positions on part of each head, "
                "an output bias); options the model cannot reproduce are refused by name. "
                "Phi-3 and Phi-4 are imported by hf-llama.")
    _add_format(formats, import_hf_gptj, "hf-gptj",
                "Hugging Face GPT-J or CodeGen: GPT-J-6B, codegen-350M to 16B "
                "(GPTJForCausalLM, CodeGenForCausalLM directory)",
                "Import a Hugging Face GPT-J or CodeGen directory (config.json, "
                "model.safetensors, its shards or pytorch_model.bin, tokenizer.json or "
                "vocab.json + merges.txt) as a decoder-only checkpoint (parallel residuals "
                "over one norm, bias-free attention, rotary positions in adjacent pairs on "
                "part of each head, an output bias); options the model cannot reproduce "
                "are refused by name.", aliases=["hf-codegen"])
    _add_format(formats, import_hf_llama, "hf-llama",
                "Hugging Face Llama, Mistral, Qwen2, Qwen3 or Phi-3 (LlamaForCausalLM, "
                "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM "
                "directory)",
                "Import a Hugging Face Llama, Mistral, Qwen2, Qwen3 or Phi-3 directory "
                "(config.json, model.safetensors, its shards or pytorch_model.bin, "
                "tokenizer.json) as a decoder-only checkpoint (RMSNorm, rotary positions, "
                "SwiGLU, grouped-query attention); options the model cannot reproduce are "
                "refused by name.")
    _add_format(formats, import_hf_gemma, "hf-gemma",
                "Hugging Face Gemma 3 (Gemma3ForCausalLM: 270M, 1B; the language model of "
                "Gemma3ForConditionalGeneration: 4B, 12B, 27B) or Gemma 2 "
                "(Gemma2ForCausalLM)",
                "Import a Hugging Face Gemma 3 directory (config.json, "
                "model.safetensors or its shards, tokenizer.json) as a decoder-only "
                "checkpoint (five sliding-window layers to one full, two rotary bases, "
                "sandwich norms; Gemma 2's soft-capped scores and logits); a multimodal "
                "one's vision tower is left out; options the model cannot reproduce are "
                "refused by name.")
    _add_format(formats, import_hf_bert, "hf-bert",
                "Hugging Face BERT (BertModel, BertForMaskedLM, BertForPreTraining or "
                "BertForSequenceClassification directory)",
                "Import a Hugging Face BERT directory (config.json, model.safetensors or "
                "pytorch_model.bin, tokenizer.json or vocab.txt) as an encoder-only "
                "checkpoint; heads the directory lacks are initialised afresh and listed, "
                "options the model cannot reproduce are refused by name.")
    _add_format(formats, import_hf_roberta, "hf-roberta",
                "Hugging Face RoBERTa, XLM-RoBERTa or CamemBERT (RobertaModel, "
                "RobertaForMaskedLM or RobertaForSequenceClassification directory, or "
                "their XLM-R / CamemBERT twins)",
                "Import a Hugging Face RoBERTa, XLM-RoBERTa or CamemBERT directory "
                "(config.json, model.safetensors or pytorch_model.bin, tokenizer.json or "
                "vocab.json + merges.txt) as an encoder-only checkpoint; heads the directory "
                "lacks are initialised afresh and listed, options the model cannot "
                "reproduce are refused by name.", aliases=["hf-xlm-roberta"])
    _add_format(formats, import_hf_distilbert, "hf-distilbert",
                "Hugging Face DistilBERT (DistilBertModel, DistilBertForMaskedLM or "
                "DistilBertForSequenceClassification directory)",
                "Import a Hugging Face DistilBERT directory (config.json, model.safetensors "
                "or pytorch_model.bin, tokenizer.json or vocab.txt) as an encoder-only "
                "checkpoint without segment embeddings; heads the directory lacks are "
                "initialised afresh and listed, options the model cannot reproduce are "
                "refused by name.")
    _add_format(formats, import_hf_electra, "hf-electra",
                "Hugging Face ELECTRA (ElectraModel, ElectraForPreTraining, "
                "ElectraForSequenceClassification, ...ForTokenClassification or "
                "...ForQuestionAnswering directory)",
                "Import a Hugging Face ELECTRA directory (config.json, model.safetensors "
                "or pytorch_model.bin, tokenizer.json or vocab.txt) as an encoder-only "
                "checkpoint whose classifier's pooler is followed by GELU (embeddings "
                "narrower than the layers, ELECTRA-small's, projected); a "
                "discriminator's head is left unread, heads the directory lacks are "
                "initialised afresh and listed, options the model cannot reproduce are "
                "refused by name.")
    _add_format(formats, import_hf_modernbert, "hf-modernbert",
                "Hugging Face ModernBERT (ModernBertModel, ModernBertForMaskedLM, "
                "...ForSequenceClassification, ...ForTokenClassification or "
                "...ForQuestionAnswering directory)",
                "Import a Hugging Face ModernBERT directory (config.json, model.safetensors "
                "or pytorch_model.bin, tokenizer.json) as an encoder-only checkpoint with "
                "ModernBERT's layout (pre-norm, rotary positions, GeGLU, sliding-window "
                "layers among full ones, heads through a prediction head); heads the "
                "directory lacks are initialised afresh and listed, options the model "
                "cannot reproduce are refused by name.")
    _add_format(formats, import_hf_deberta, "hf-deberta",
                "Hugging Face DeBERTa-v3 or -v2 (DebertaV2Model, DebertaV2ForMaskedLM, "
                "...ForSequenceClassification, ...ForTokenClassification or "
                "...ForQuestionAnswering directory)",
                "Import a Hugging Face DeBERTa-v3 directory (config.json, model.safetensors "
                "or pytorch_model.bin, tokenizer.json or spm.model) as an encoder-only "
                "checkpoint with disentangled attention (relative positions in "
                "logarithmic buckets, shared by the layers); a pre-trained model's "
                "replaced-token head is left unread, heads the directory lacks are "
                "initialised afresh and listed, options the model cannot reproduce are "
                "refused by name.")
    _add_format(formats, import_hf_marian, "hf-marian",
                "Hugging Face Marian (MarianMTModel directory: OPUS-MT)",
                "Import a Hugging Face Marian translation model (config.json, "
                "model.safetensors or pytorch_model.bin, source.spm, vocab.json) as an "
                "encoder-decoder checkpoint that translates, serves and exports as ours do; "
                "options the model cannot reproduce are refused by name.")
    _add_format(formats, import_hf_nllb, "hf-nllb",
                "Hugging Face NLLB-200 or M2M-100 (M2M100ForConditionalGeneration directory)",
                "Import a Hugging Face NLLB-200 or M2M-100 translation model (config.json, "
                "model.safetensors or pytorch_model.bin, sentencepiece.bpe.model with "
                "NLLB's tokenizer.json or M2M-100's vocab.json) as a multilingual "
                "encoder-decoder checkpoint: translate with --source-lang and --target-lang "
                "(NLLB's eng_Latn, fra_Latn, ...; M2M-100's en, fr, ...); options the model "
                "cannot reproduce are refused by name.", aliases=["hf-m2m100"])
    _add_format(formats, import_hf_mbart, "hf-mbart",
                "Hugging Face mBART-50 (MBartForConditionalGeneration directory with "
                "MBart50Tokenizer's files)",
                "Import a Hugging Face mBART-50 translation model (config.json, "
                "model.safetensors or pytorch_model.bin, sentencepiece.bpe.model) as a "
                "multilingual encoder-decoder checkpoint: translate with --source-lang and "
                "--target-lang (en_XX, fr_XX, ...); mBART-25's layout and options the model "
                "cannot reproduce are refused by name.")
    _add_format(formats, import_hf_t5, "hf-t5",
                "Hugging Face T5, Flan-T5 or mT5 (T5ForConditionalGeneration directory)",
                "Import a Hugging Face T5 model (config.json, model.safetensors or "
                "pytorch_model.bin, spiece.model) as an encoder-decoder checkpoint with "
                "T5's relative positions: give it its task in the text (\"translate English "
                "to German: ...\", \"summarize: ...\"); options the model cannot reproduce "
                "are refused by name.")

    peft = formats.add_parser("peft", help="a PEFT LoRA adapter of a Llama, Mistral, Qwen2, "
                                           "Phi-3, GPT-2, BERT, RoBERTa, DistilBERT, "
                                           "Marian, NLLB, "
                                           "mBART-50 or T5 model, merged into our import "
                                           "of that model",
                              description="Merge a PEFT LoRA adapter directory "
                              "(adapter_config.json, adapter_model.safetensors) into a copy of "
                              "--base, our checkpoint of the model it was trained on (import "
                              "hf-llama, hf-gpt2, hf-bert, hf-roberta, hf-distilbert, "
                              "hf-marian, hf-nllb, "
                              "hf-mbart or hf-t5, or the checkpoint `export hf` wrote it "
                              "from); a sequence "
                              "classifier's head and pooler trained whole replace the base's. "
                              "What a merged update cannot compute (DoRA, trained biases, other "
                              "modules trained whole) is refused by name. OUT must not exist or "
                              "be empty, unless --force.")
    peft.add_argument("adapter_dir", metavar="DIR", type=Path, help="PEFT adapter directory")
    peft.add_argument("--base", type=Path, required=True,
                      help="our checkpoint of the adapter's base model")
    peft.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    peft.add_argument("--force", action="store_true", help=FORCE_HELP)
    peft.set_defaults(handler=import_peft)


def _add_format(formats, handler, name: str, summary: str, description: str,
                aliases: list[str] | None = None) -> None:
    """One `import NAME DIR --out OUT [--force]` command."""
    command = formats.add_parser(name, help=summary, aliases=aliases or [],
                                 description=description + " OUT must not exist or be "
                                 "empty, unless --force.")
    command.add_argument("hf_dir", metavar="DIR", type=Path, help="Hugging Face model directory")
    command.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    command.add_argument("--force", action="store_true", help=FORCE_HELP)
    command.set_defaults(handler=handler)


def import_hf_gpt2(args: argparse.Namespace) -> int:
    """Import a Hugging Face GPT-2 checkpoint."""
    from transduce.importers import import_gpt2

    return _import_decoder(args, import_gpt2)


def import_hf_bloom(args: argparse.Namespace) -> int:
    """Import a Hugging Face BLOOM checkpoint."""
    from transduce.importers import import_bloom

    return _import_decoder(args, import_bloom)


def import_hf_gpt_neox(args: argparse.Namespace) -> int:
    """Import a Hugging Face GPT-NeoX (Pythia) checkpoint."""
    from transduce.importers import import_gpt_neox

    return _import_decoder(args, import_gpt_neox)


def import_hf_stablelm(args: argparse.Namespace) -> int:
    """Import a Hugging Face StableLM checkpoint."""
    from transduce.importers import import_stablelm

    return _import_decoder(args, import_stablelm)


def import_hf_olmo2(args: argparse.Namespace) -> int:
    """Import a Hugging Face OLMo 2 checkpoint."""
    from transduce.importers import import_olmo2

    return _import_decoder(args, import_olmo2)


def import_hf_phi(args: argparse.Namespace) -> int:
    """Import a Hugging Face Phi-1, Phi-1.5 or Phi-2 checkpoint."""
    from transduce.importers import import_phi

    return _import_decoder(args, import_phi)


def import_hf_gptj(args: argparse.Namespace) -> int:
    """Import a Hugging Face GPT-J or CodeGen checkpoint."""
    from transduce.importers import import_gptj

    return _import_decoder(args, import_gptj)


def import_hf_llama(args: argparse.Namespace) -> int:
    """Import a Hugging Face Llama, Mistral, Qwen2, Qwen3 or Phi-3 checkpoint."""
    from transduce.importers import import_llama

    return _import_decoder(args, import_llama)


def import_hf_gemma(args: argparse.Namespace) -> int:
    """Import a Hugging Face Gemma 3 (a multimodal one's language model) or Gemma 2
    checkpoint."""
    from transduce.importers import import_gemma
    from transduce.importers.hf_gemma import is_multimodal

    _import_decoder(args, import_gemma)
    if is_multimodal(args.hf_dir):
        print("Gemma3ForConditionalGeneration: its language model only (the vision tower "
              "and its projector are left out; the model reads text)")
    return 0


def _import_decoder(args: argparse.Namespace, importer) -> int:
    """Import a decoder-only checkpoint and say what it holds."""
    out, model = _imported(args, importer)
    config = model.config
    _say_written(out, "decoder-only", config.num_decoder_layers, config, config.tgt_vocab_size)
    return 0


def import_hf_bert(args: argparse.Namespace) -> int:
    """Import a Hugging Face BERT checkpoint."""
    from transduce.importers import import_bert

    return _import_encoder(args, import_bert)


def import_hf_roberta(args: argparse.Namespace) -> int:
    """Import a Hugging Face RoBERTa, XLM-RoBERTa or CamemBERT checkpoint."""
    from transduce.importers import import_roberta

    return _import_encoder(args, import_roberta)


def import_hf_deberta(args: argparse.Namespace) -> int:
    """Import a Hugging Face DeBERTa-v3 or -v2 checkpoint."""
    from transduce.importers import import_deberta

    return _import_encoder(args, import_deberta)


def import_hf_distilbert(args: argparse.Namespace) -> int:
    """Import a Hugging Face DistilBERT checkpoint."""
    from transduce.importers import import_distilbert

    return _import_encoder(args, import_distilbert)


def import_hf_electra(args: argparse.Namespace) -> int:
    """Import a Hugging Face ELECTRA checkpoint."""
    from transduce.importers import import_electra

    return _import_encoder(args, import_electra)


def import_hf_modernbert(args: argparse.Namespace) -> int:
    """Import a Hugging Face ModernBERT checkpoint."""
    from transduce.importers import import_modernbert

    return _import_encoder(args, import_modernbert)


def _import_encoder(args: argparse.Namespace, importer) -> int:
    """Import an encoder-only checkpoint, say what it holds and which heads it lacked."""
    from transduce import checkpoint
    from transduce.importers import fresh_heads
    from transduce.importers.hf_bert import HEADS, dropped_heads

    out, model = _imported(args, importer)
    config = model.config
    _say_written(out, "encoder-only", config.num_encoder_layers, config, config.src_vocab_size,
                 f", {config.num_labels} labels" if config.num_labels else "")
    recorded = checkpoint.read_sentence_embedding(out)
    if recorded:
        print(f"sentence embeddings (modules.json): {recorded['pooling']} pooling, "
              f"{'L2-normalised' if recorded['normalize'] else 'not normalised'}")
    fresh = fresh_heads(out)
    if fresh:
        print(f"not in {args.hf_dir}, initialised afresh (train before use): "
              f"{', '.join(f'{HEADS[head]} ({head})' for head in fresh)}")
    dropped = dropped_heads(out)
    if dropped:
        print(f"left unread (ours has no place for them): {', '.join(dropped)}")
    return 0


def import_hf_marian(args: argparse.Namespace) -> int:
    """Import a Hugging Face Marian checkpoint."""
    from transduce import checkpoint
    from transduce.data.tokenizer import Tokenizer
    from transduce.importers import import_marian

    out, model = _imported(args, import_marian)
    config = model.config
    sizes = (config.src_vocab_size, config.tgt_vocab_size)
    _say_written(out, "encoder-decoder", f"{config.num_encoder_layers} + "
                 f"{config.num_decoder_layers}", config,
                 f"{sizes[0]} source, {sizes[1]} target" if Tokenizer(
                     out / checkpoint.TOKENIZER).separate else sizes[1],
                 f", {model.languages[0]} -> {model.languages[1]}" if model.languages else "")
    return 0


def import_hf_nllb(args: argparse.Namespace) -> int:
    """Import a Hugging Face NLLB-200 or M2M-100 checkpoint."""
    from transduce.importers import import_nllb

    return _say_multilingual(*_imported(args, import_nllb))


def _say_multilingual(out: Path, model) -> int:
    """What a multilingual encoder-decoder import wrote (NLLB's, M2M-100's, mBART's)."""
    config = model.config
    _say_written(out, "encoder-decoder", f"{config.num_encoder_layers} + "
                 f"{config.num_decoder_layers}", config, config.tgt_vocab_size,
                 f", {len(model.language_codes)} languages")
    return 0


def import_hf_mbart(args: argparse.Namespace) -> int:
    """Import a Hugging Face mBART-50 checkpoint."""
    from transduce.importers import import_mbart

    return _say_multilingual(*_imported(args, import_mbart))


def import_hf_t5(args: argparse.Namespace) -> int:
    """Import a Hugging Face T5 checkpoint."""
    from transduce.importers import import_t5

    out, model = _imported(args, import_t5)
    config = model.config
    _say_written(out, "encoder-decoder", f"{config.num_encoder_layers} + "
                 f"{config.num_decoder_layers}", config, config.tgt_vocab_size)
    return 0


def _say_written(out: Path, shape: str, layers, config, vocabulary: int | str,
                 more: str = "") -> None:
    """One line on what an import wrote: its shape, layers, width, heads (and key/value
    heads where fewer), vocabulary, and `more`."""
    grouped = f", {config.kv_heads} key/value heads" if config.kv_heads != config.num_heads \
        else ""
    print(f"wrote {out} ({shape}: {layers} layers, d_model {config.d_model}, "
          f"{config.num_heads} heads{grouped}, vocabulary {vocabulary}{more})")


def _imported(args: argparse.Namespace, importer):
    """Run `importer` from args.hf_dir into args.out (checked first) -> (the checkpoint
    written, its model as loaded back)."""
    from transduce.model import load_model

    check_output_directory(args.out, "--out", force=args.force, reads=args.hf_dir)
    out = importer(args.hf_dir, args.out)
    return out, load_model(out)


def import_peft(args: argparse.Namespace) -> int:
    """Merge a PEFT LoRA adapter into a copy of our checkpoint of its base model."""
    from transduce.importers import import_peft as merge
    from transduce.model import load_model

    check_output_directory(args.out, "--out", force=args.force, reads=args.adapter_dir)
    check_output_directory(args.out, "--out", force=args.force, reads=args.base)
    out = merge(args.adapter_dir, args.base, args.out)
    c = load_model(out).config
    shape, layers = {"encoder": ("encoder-only", c.num_encoder_layers),
                     "decoder": ("decoder-only", c.num_decoder_layers)}.get(
        c.arch, ("encoder-decoder", f"{c.num_encoder_layers} + {c.num_decoder_layers}"))
    _say_written(out, shape, layers, c, c.tgt_vocab_size,
                 f"; {args.adapter_dir} merged into {args.base}")
    return 0
