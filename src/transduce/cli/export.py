"""`transduce export hf | ct2 | onnx | peft`: a checkpoint in another toolkit's format."""

from __future__ import annotations

import argparse
from pathlib import Path

from transduce.cli.outputs import FORCE_HELP, check_output_directory

CT2_QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16")


def register(commands) -> None:
    export = commands.add_parser("export", help="write a checkpoint in another toolkit's format")
    formats = export.add_subparsers(dest="format", required=True)
    hf = formats.add_parser("hf", help="Hugging Face transformers: Marian (post-norm) or "
                                     "Pegasus (pre-norm); an NLLB or M2M-100 import as "
                                     "itself; a language model as Llama (rotary "
                                     "positions) or GPT-2; an encoder as BERT")
    hf.add_argument("model", type=Path, help="checkpoint or run directory")
    hf.add_argument("out", type=Path, help="directory to write")
    hf.add_argument("--force", action="store_true", help=FORCE_HELP)
    hf.set_defaults(handler=export_hf)
    ct2 = formats.add_parser("ct2", help="CTranslate2: a Translator's model, a "
                                         "Generator's for a language model, an Encoder's "
                                         "for an encoder")
    ct2.add_argument("model", type=Path, help="checkpoint or run directory")
    ct2.add_argument("out", type=Path, help="directory to write")
    ct2.add_argument("--force", action="store_true", help=FORCE_HELP)
    ct2.add_argument("--quantization", default=None, choices=CT2_QUANTIZATIONS,
                     help="weight type (default: float32)")
    ct2.set_defaults(handler=export_ct2)
    onnx = formats.add_parser("onnx", help="ONNX, for ONNX Runtime: encoder.onnx and "
                                           "decoder_step.onnx with the KV cache, a language "
                                           "model's decoder.onnx, an encoder's "
                                           "sentence_encoder.onnx")
    onnx.add_argument("model", type=Path, help="checkpoint or run directory")
    onnx.add_argument("out", type=Path, help="directory to write")
    onnx.add_argument("--force", action="store_true", help=FORCE_HELP)
    onnx.add_argument("--quantize", default=None, choices=("int8",),
                      help="int8: weights int8 per channel (ONNX Runtime dynamic quantization; "
                           "a tied embedding once, a scale per token)")
    onnx.set_defaults(handler=export_onnx)
    peft = formats.add_parser("peft", help="a LoRA run's adapters as a PEFT adapter, for "
                                           "the Hugging Face export of the checkpoint it "
                                           "started from (language models, encoders, "
                                           "encoder-decoders)")
    peft.add_argument("model", type=Path, help="a LoRA run's checkpoint or run directory")
    peft.add_argument("out", type=Path, help="directory to write")
    peft.add_argument("--force", action="store_true", help=FORCE_HELP)
    peft.set_defaults(handler=export_peft)


def export_hf(args: argparse.Namespace) -> int:
    """Write a checkpoint as a Hugging Face Marian, Pegasus, T5, Llama, GPT-2, BERT,
    RoBERTa or DistilBERT model."""
    import json

    from transduce.export import export_hf as write

    check_output_directory(args.out, "OUT", force=args.force, reads=args.model)
    out = write(args.model, args.out)
    written = json.loads((out / "config.json").read_text(encoding="utf-8"))
    written_class = written["architectures"][0]
    auto = next((f"AutoModel{task}" for task in ("ForSequenceClassification", "ForPreTraining",
                                                 "ForMaskedLM", "ForTokenClassification",
                                                 "ForQuestionAnswering")
                 if written_class.endswith(task)),
                "AutoModelForSeq2SeqLM" if written.get("is_encoder_decoder")
                else "AutoModelForCausalLM")
    print(f"wrote {out} ({written_class}: load it with transformers.{auto}"
          f".from_pretrained and AutoTokenizer.from_pretrained)")
    return 0


def export_ct2(args: argparse.Namespace) -> int:
    """Write a checkpoint as a CTranslate2 model."""
    from transduce import checkpoint
    from transduce.export import export_ctranslate2

    check_output_directory(args.out, "OUT", force=args.force, reads=args.model)
    out = export_ctranslate2(args.model, args.out, args.quantization)
    config, _ = checkpoint.read_configs(checkpoint.resolve(args.model))
    kind = "Generator" if config.arch == "decoder" else "Translator"
    tokenizer = next(out / name for name in ("spm.model", "tokenizer.json")
                     if (out / name).is_file())
    print(f"wrote {out} (load it with ctranslate2.{kind}; tokenizer: {tokenizer})")
    return 0


def export_onnx(args: argparse.Namespace) -> int:
    """Write a checkpoint as ONNX graphs (an encoder-decoder's prefill and decode step,
    or a language model's or an encoder's one graph)."""
    from transduce.export.onnx import export_onnx as write
    from transduce.onnx_format import DECODER, SENTENCE_ENCODER

    check_output_directory(args.out, "OUT", force=args.force, reads=args.model)
    out = write(args.model, args.out, args.quantize)
    commands = {DECODER: "generate", SENTENCE_ENCODER: "classify|embed"}
    command = next((c for graph, c in commands.items() if (out / graph).is_file()), "translate")
    print(f"wrote {out} (run it with `transduce {command} --model {out}`, or "
          f"transduce.load({str(out)!r}))")
    return 0


def export_peft(args: argparse.Namespace) -> int:
    """Write a LoRA run's adapters as a PEFT adapter directory."""
    from transduce import checkpoint
    from transduce.export import export_peft as write

    check_output_directory(args.out, "OUT", force=args.force, reads=args.model)
    out = write(args.model, args.out)
    base = checkpoint.read_lora_section(checkpoint.resolve(args.model))["base"]
    print(f"wrote {out} (load it with peft.PeftModel.from_pretrained on the model that "
          f"`transduce export hf {base}` writes)")
    return 0
