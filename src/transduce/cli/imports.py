"""`transduce import hf-gpt2` / `hf-bert`: another toolkit's checkpoint as ours."""

from __future__ import annotations

import argparse
from pathlib import Path

from transduce.cli.outputs import FORCE_HELP, check_output_directory


def register(commands) -> None:
    imports = commands.add_parser("import", help="read another toolkit's checkpoint into a "
                                                 "checkpoint of ours")
    formats = imports.add_subparsers(dest="format", required=True)
    gpt2 = formats.add_parser(
        "hf-gpt2", help="Hugging Face GPT-2 (GPT2LMHeadModel directory)",
        description="Import a Hugging Face GPT-2 directory (config.json, model.safetensors "
                    "or pytorch_model.bin, tokenizer.json or vocab.json + merges.txt) as a "
                    "decoder-only checkpoint; options the model cannot reproduce are "
                    "refused by name. OUT must not exist or be empty, unless --force.")
    gpt2.add_argument("hf_dir", metavar="DIR", type=Path, help="Hugging Face model directory")
    gpt2.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    gpt2.add_argument("--force", action="store_true", help=FORCE_HELP)
    gpt2.set_defaults(handler=import_hf_gpt2)
    bert = formats.add_parser(
        "hf-bert", help="Hugging Face BERT (BertModel, BertForMaskedLM, BertForPreTraining "
                        "or BertForSequenceClassification directory)",
        description="Import a Hugging Face BERT directory (config.json, model.safetensors "
                    "or pytorch_model.bin, tokenizer.json or vocab.txt) as an encoder-only "
                    "checkpoint; heads the directory lacks are initialised afresh and "
                    "listed, options the model cannot reproduce are refused by name. OUT "
                    "must not exist or be empty, unless --force.")
    bert.add_argument("hf_dir", metavar="DIR", type=Path, help="Hugging Face model directory")
    bert.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    bert.add_argument("--force", action="store_true", help=FORCE_HELP)
    bert.set_defaults(handler=import_hf_bert)


def import_hf_gpt2(args: argparse.Namespace) -> int:
    """Import a Hugging Face GPT-2 checkpoint."""
    from transduce.importers import import_gpt2
    from transduce.model import load_model

    check_output_directory(args.out, "--out", force=args.force, reads=args.hf_dir)
    out = import_gpt2(args.hf_dir, args.out)
    config = load_model(out).config
    print(f"wrote {out} (decoder-only: {config.num_decoder_layers} layers, d_model "
          f"{config.d_model}, {config.num_heads} heads, vocabulary {config.tgt_vocab_size})")
    return 0


def import_hf_bert(args: argparse.Namespace) -> int:
    """Import a Hugging Face BERT checkpoint."""
    from transduce.importers import fresh_heads, import_bert
    from transduce.importers.hf_bert import HEADS
    from transduce.model import load_model

    check_output_directory(args.out, "--out", force=args.force, reads=args.hf_dir)
    out = import_bert(args.hf_dir, args.out)
    model = load_model(out)
    config = model.config
    labels = f", {config.num_labels} labels" if config.num_labels else ""
    print(f"wrote {out} (encoder-only: {config.num_encoder_layers} layers, d_model "
          f"{config.d_model}, {config.num_heads} heads, vocabulary {config.src_vocab_size}"
          f"{labels})")
    fresh = fresh_heads(out)
    if fresh:
        print(f"not in {args.hf_dir}, initialised afresh (train before use): "
              f"{', '.join(f'{HEADS[head]} ({head})' for head in fresh)}")
    return 0
