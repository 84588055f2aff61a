"""`transduce train | average | plot`: training runs and what is made from them."""

from __future__ import annotations

import argparse
from pathlib import Path

from transduce.cli.outputs import FORCE_HELP, check_directory_path, check_output_directory
from transduce.cli.options import add_config_flags, flags_given, fraction, positive_int, \
    read_config_file
from transduce.config import PRESETS, ConfigError, ModelConfig, TrainConfig, preset, \
    train_recipe

DEFAULT_PRESET = "small"
DECODER_PRESET = "gpt-small"    # the default preset of a language model (--arch decoder)
ENCODER_PRESET = "bert-small"   # the default preset of an encoder (--arch encoder)
DEFAULT_PRESETS = {"decoder": DECODER_PRESET, "encoder": ENCODER_PRESET}
# Fine-tuning a pre-trained encoder into a classifier (--init with --task classify): a
# short warmup and a peak of lr_scale 0.05 (3.1e-4 at d_model 256), no smoothing; flags
# and the config file's [train] override it. Chosen on dev accuracy of the genre task
# (docs/experiments.md): at lr_scale 0.3 fine-tuning overwrote what masked-LM
# pre-training had learnt (dev accuracy 60.0% against 79.1%).
FINE_TUNING: dict = {"task": "classify", "max_tokens": 2048, "warmup_steps": 100,
                     "lr_scale": 0.05, "label_smoothing": 0.0}
# A question answerer reads windows of BERT's max_seq_length for SQuAD, 384 positions (the
# model's, if fewer), 128 of them shared by consecutive windows.
ANSWER_FINE_TUNING: dict = {"max_len": 384}
# Training on from an import (--init of a checkpoint that records no recipe: GPT-2 or
# Llama on one's own text, BERT's masked LM on one's own domain): the budget schedule,
# warmup over a tenth of the budget to lr_scale x (d_model x warmup_steps)^-0.5, then
# linear decay to 0, no smoothing. The peak is 7.2e-5 at GPT-2's width (768), 3.1e-5
# at Llama 7B's (4096): the range fine-tuning recipes use.
IMPORT_TRAINING: dict = {"max_tokens": 2048, "schedule": "budget", "warmup_fraction": 0.1,
                         "warmup_steps": 100, "lr_scale": 0.02, "label_smoothing": 0.0}
# LoRA's adapters (--lora-rank) train at 10x the rate of the whole model unless --lr-scale
# or the config file sets it: from the KJV to the WEB in 300 steps, adapters at 10x reached
# the perplexity of the whole model at 1x (docs/experiments.md, "LoRA against fine-tuning
# the whole model"); at Llama 7B's width the import recipe's peak becomes 3.1e-4, near the
# 1e-4 to 3e-4 that LoRA and QLoRA fine-tuned with.
LORA_LR_FACTOR = 10.0
HEAD_TASKS = ("classify", "tag", "answer")    # the tasks that train a head on an encoder


def register(commands) -> None:
    train = commands.add_parser("train", help="train a model with the paper's recipe")
    train.add_argument("--data", type=Path, required=True,
                       help="corpus directory with spm.model (or none, when --init's "
                            "checkpoint brings its vocabulary)")
    train.add_argument("--out", type=Path, required=True, help="run directory for checkpoints")
    train.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="model preset (default: the config file's, else small, or "
                            f"{DECODER_PRESET} with --arch decoder, {ENCODER_PRESET} with "
                            f"--arch encoder)")
    train.add_argument("--config", type=Path, default=None,
                       help="TOML file: preset, [model], [train]")
    train.add_argument("--resume", action="store_true", help="continue the run in --out exactly")
    train.add_argument("--init", type=Path, default=None,
                       help="start from this checkpoint's weights (uptraining a converted "
                            "model; with --task classify, tag or answer, fine-tuning a "
                            "pre-trained encoder with a new head); an imported BERT, "
                            "RoBERTa or DistilBERT reads the corpus with its own tokenizer")
    train.add_argument("--uptrain-fraction", type=fraction, default=0.05,
                       help="with --init and no budget: this fraction of its training steps")
    add_config_flags(train, TrainConfig)
    add_config_flags(train, ModelConfig)
    train.set_defaults(handler=train_command)

    average = commands.add_parser("average", help="average a run's last checkpoints")
    average.add_argument("run_dir", metavar="RUN", type=Path)
    average.add_argument("--last", type=positive_int, default=5)
    average.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    average.add_argument("--force", action="store_true", help=FORCE_HELP)
    average.set_defaults(handler=average_command)

    plot = commands.add_parser("plot", help="plot a run's curves, or several runs' dev BLEU "
                                            "against minutes")
    plot.add_argument("run_dirs", metavar="RUN", type=Path, nargs="+")
    plot.add_argument("--out", type=Path, default=None,
                      help="PNG path (default RUN/curves.png for one run; needed for several)")
    plot.set_defaults(handler=plot_command)


def train_command(args: argparse.Namespace) -> int:
    """Train a model on a corpus directory: a new run, a resumed one, or an uptraining."""
    from transduce import checkpoint
    from transduce.data.corpus import corpus_kind
    from transduce.runtime import keep_freed_memory
    from transduce.train.loop import train

    keep_freed_memory()  # a process setting: the command line's to make, not the library's
    check_directory_path(args.out, "--out")
    corpus_kind(args.data)   # a missing corpus is named as such, before its vocabulary is read
    file_values = read_config_file(args.config)
    if args.init is not None and flags_given(args, TrainConfig).get("task") in HEAD_TASKS:
        model_config, train_config = _fine_tuning_configs(args, file_values)
    elif args.init is not None:
        model_config, train_config = _uptraining_configs(args, file_values)
    elif args.resume:
        model_config, train_config = _resumed_configs(args, file_values)
    else:
        model_config, train_config = _new_run_configs(args, file_values)
    if not args.resume and checkpoint.list_checkpoints(args.out):
        resume = "" if args.init else "pass --resume to continue that run, or "
        raise ConfigError(f"{args.out} already holds checkpoints: {resume}choose another --out")
    train(args.data, args.out, model_config, train_config, resume=args.resume, init=args.init)
    return 0


def _new_run_configs(args: argparse.Namespace, file_values: dict
                     ) -> tuple[ModelConfig, TrainConfig]:
    """The preset (flag, config file, else small, or gpt-small for arch decoder) with the
    file's and the flags' fields; the vocabulary sizes are the corpus vocabulary's."""
    name, model_config = _described_model(args, file_values)
    chosen = {**file_values.get("train", {}), **flags_given(args, TrainConfig)}
    values = {**train_recipe(name), **chosen}
    if values.get("schedule") == "budget" and "schedule" not in chosen \
            and not (values.get("max_minutes") or values.get("max_steps")):
        raise ConfigError(f"preset {name!r} trains with a schedule that ends with the budget: "
                          "give --max-minutes or --max-steps (or --schedule noam for a run "
                          "without one)")
    return model_config, TrainConfig(**values)


def _described_model(args: argparse.Namespace, file_values: dict) -> tuple[str, ModelConfig]:
    """The preset's name and the model it gives with the file's and the flags' fields;
    with separate vocabularies, the target embedding is tied to the output alone."""
    from transduce.data.tokenizer import MODEL_NAME, Tokenizer

    tokenizer = Tokenizer(args.data / MODEL_NAME)
    model_values = {"src_vocab_size": tokenizer.vocab_size,
                    "tgt_vocab_size": tokenizer.target_tokenizer.vocab_size,
                    **({"tie_embeddings": "decoder"} if tokenizer.separate else {}),
                    **file_values.get("model", {}), **flags_given(args, ModelConfig)}
    default = DEFAULT_PRESETS.get(model_values.get("arch"), DEFAULT_PRESET)
    name = args.preset or file_values.get("preset", default)
    chosen = {**file_values.get("train", {}), **flags_given(args, TrainConfig)}
    if chosen.get("task") in HEAD_TASKS:
        model_values = {**_head(args.data, chosen["task"]), **model_values}
    return name, preset(name, **model_values)


def _resumed_configs(args: argparse.Namespace, file_values: dict
                     ) -> tuple[ModelConfig, TrainConfig]:
    """The run's saved model, and its recipe with the file's and the flags' fields."""
    from transduce import checkpoint

    model_config, saved_train = checkpoint.read_configs(checkpoint.resolve(args.out))
    _check_resumed_model(args, file_values, model_config)
    return model_config, (saved_train or TrainConfig()).replace(
        **file_values.get("train", {}), **flags_given(args, TrainConfig))


def _check_resumed_model(args: argparse.Namespace, file_values: dict, saved: ModelConfig
                         ) -> None:
    """--resume repeated with the run's first command line (its --preset, --config or
    model flags) is fine; model choices that describe another model are refused."""
    if not _model_choices(args, file_values):
        return
    described, run = _described_model(args, file_values)[1].to_dict(), saved.to_dict()
    differing = [f"{name} {value!r} (the run: {run[name]!r})"
                 for name, value in described.items() if run.get(name) != value]
    if differing:
        raise ConfigError(f"--resume continues the run's model; the --preset, --config and "
                          f"model flags given describe another: {', '.join(differing)}")


def _head(data_dir: Path, task: str) -> dict:
    """The ModelConfig fields of the head a task trains: a classifier of the corpus's
    classes, a tagger of its tags, or a question answerer (a start and an end)."""
    from transduce.data.corpus import corpus_kind
    from transduce.data.labelled import class_names
    from transduce.data.tagged import tag_names
    if task == "answer":
        return {"num_labels": 2, "token_classifier": False, "question_answering": True}
    head = {"token_classifier": task == "tag", "question_answering": False}
    kind = corpus_kind(data_dir)
    if kind not in ("tagging", "classification"):
        return head              # the wrong corpus for the task: the training checks say so
    names = tag_names(data_dir) if kind == "tagging" else class_names(data_dir)
    return {"num_labels": len(names), **head}


def _fine_tuning_configs(args: argparse.Namespace, file_values: dict
                         ) -> tuple[ModelConfig, TrainConfig]:
    """A pre-trained encoder's model with the head the task trains (_head), and the
    fine-tuning recipe (FINE_TUNING; an answerer's windows, ANSWER_FINE_TUNING) with the
    file's and the flags' fields."""
    from transduce import checkpoint

    if args.resume:
        raise ConfigError("--init starts a new run from a checkpoint's weights; --resume "
                          "continues a run: choose one")
    dropouts = ("dropout", "attention_dropout")
    _refuse_model_choices(args, file_values, "--init keeps the checkpoint's model",
                          allowed=dropouts)
    model_flags = {name: value for name, value in {**file_values.get("model", {}),
                                                   **flags_given(args, ModelConfig)}.items()
                   if name in dropouts}
    saved, _ = checkpoint.read_configs(checkpoint.resolve(args.init))
    if saved.arch != "encoder":
        raise ConfigError(f"--task classify, tag and answer fine-tune an encoder; --init "
                          f"{args.init} is arch {saved.arch!r}")
    given = flags_given(args, TrainConfig)
    recipe = {**FINE_TUNING, **(ANSWER_FINE_TUNING if given["task"] == "answer" else {})}
    train_config = TrainConfig(**{**recipe, **file_values.get("train", {}), **given})
    model_config = saved.replace(**_head(args.data, train_config.task), **model_flags)
    if _takes_lora_rate(train_config, args, file_values):
        train_config = _lora_rated(train_config)
    return model_config, train_config


def _uptraining_configs(args: argparse.Namespace, file_values: dict
                        ) -> tuple[ModelConfig, TrainConfig]:
    """The checkpoint's model and recipe (warmup, batch size, smoothing...) with a new
    budget: a fraction of its steps, the schedule continued (train/uptrain.py); an
    import's model with IMPORT_TRAINING and the budget given."""
    from transduce import checkpoint
    from transduce.train.uptrain import uptraining_defaults

    if args.resume:
        raise ConfigError("--init starts a new run from a checkpoint's weights; --resume "
                          "continues a run: choose one")
    _refuse_model_choices(args, file_values, "--init keeps the checkpoint's model")
    train_flags = flags_given(args, TrainConfig)
    model_config, saved_train = checkpoint.read_configs(checkpoint.resolve(args.init))
    recipe = {**(saved_train.to_dict() if saved_train else IMPORT_TRAINING), "max_steps": 0,
              "max_minutes": 0.0, "schedule_offset": 0}
    defaults = uptraining_defaults(args.init, train_flags, args.uptrain_fraction)
    file_train = file_values.get("train", {})
    train_config = TrainConfig(**{**recipe, **file_train, **defaults, **train_flags})
    # A LoRA run's own recipe has its adapters' rate already.
    lora_rate = _takes_lora_rate(train_config, args, file_values) and \
        not (saved_train and saved_train.lora_rank)
    if lora_rate:
        train_config = _lora_rated(train_config)
    if "schedule_offset" in defaults:
        print(uptraining_plan(args.init, train_config, defaults, args.uptrain_fraction))
    elif saved_train is None:
        print(import_training_plan(args.init, train_config, model_config.d_model, lora_rate))
    return model_config, train_config


def _takes_lora_rate(config: TrainConfig, args: argparse.Namespace, file_values: dict
                     ) -> bool:
    """Whether a run trains LoRA adapters at LORA_LR_FACTOR times the recipe's rate: it
    trains adapters, and neither --lr-scale nor the config file chose the rate."""
    chosen = "lr_scale" in flags_given(args, TrainConfig) or \
        "lr_scale" in file_values.get("train", {})
    return bool(config.lora_rank) and not chosen


def _lora_rated(config: TrainConfig) -> TrainConfig:
    return config.replace(lr_scale=config.lr_scale * LORA_LR_FACTOR)


def import_training_plan(init: Path, config: TrainConfig, d_model: int,
                         lora_rate: bool = False) -> str:
    """What training on from an import will do with its learning rate, said before it
    starts. lora_rate: the rate is LoRA's default, LORA_LR_FACTOR times the recipe's."""
    peak = config.lr_scale * (d_model * config.warmup_steps) ** -0.5
    lora = f" (LoRA: {LORA_LR_FACTOR:g}x the whole model's)" if lora_rate else ""
    if config.schedule == "noam":
        return (f"training on from {init} (an import, no recipe of its own): the noam "
                f"schedule, peak learning rate {peak:.2g}{lora} at step {config.warmup_steps}")
    return (f"training on from {init} (an import, no recipe of its own): learning rate "
            f"warmed up over {config.warmup_fraction:.3g} of the budget to {peak:.2g}{lora}, "
            f"then decayed to 0; pass --lr-scale to move the peak")


def uptraining_plan(init: Path, config: TrainConfig, defaults: dict, fraction: float) -> str:
    """What the uptraining run will do with its learning rate, said before it starts."""
    budget = f"; {defaults['max_steps']} more ({fraction:.3g} of them)" \
        if "max_steps" in defaults else ""
    # the checkpoint's steps, whatever --schedule-offset says (the schedule follows that)
    trained = f"uptraining from {init}: trained {defaults['schedule_offset']} steps{budget}; "
    if config.schedule == "noam":
        return trained + f"the noam schedule continues from step {config.schedule_offset + 1}"
    # A budget schedule ends at 0, so continuing it would train at rate 0: warm up again
    # and decay over the new budget (re-warming, as continued pre-training does).
    return trained + (f"the budget schedule starts again over this run (warmup over "
                      f"{config.warmup_fraction:.3g} of it, then decay to 0), since the "
                      f"checkpoint's own schedule ended at 0")


def _refuse_model_choices(args: argparse.Namespace, file_values: dict, why: str,
                          allowed: tuple[str, ...] = ()) -> None:
    """A run that keeps a saved model refuses what would choose another but `allowed`."""
    chosen = _model_choices(args, file_values, allowed)
    if chosen:
        raise ConfigError(f"{why}; it cannot change {', '.join(chosen)}")


def _model_choices(args: argparse.Namespace, file_values: dict,
                   allowed: tuple[str, ...] = ()) -> list[str]:
    """What chooses a model (--preset, the model's flags, the --config file's preset and
    [model] fields) but `allowed`, each named as the user wrote it."""
    chosen = ["--preset"] if args.preset else []
    chosen += [f"--{name.replace('_', '-')}" for name in flags_given(args, ModelConfig)
               if name not in allowed]
    chosen += [f"{args.config}: preset"] if "preset" in file_values else []
    chosen += [f"{args.config}: [model] {name}" for name in file_values.get("model", {})
               if name not in allowed]
    return chosen


def average_command(args: argparse.Namespace) -> int:
    """Average the weights of a run's last N checkpoints (the paper: 5 for base)."""
    from transduce import checkpoint
    from transduce.errors import not_there

    check_output_directory(args.out, "--out", force=args.force, reads=args.run_dir)
    if not args.run_dir.is_dir():
        raise checkpoint.CheckpointError(not_there(args.run_dir, "run directory"))
    found = checkpoint.list_checkpoints(args.run_dir)
    if not found:
        raise checkpoint.CheckpointError(f"{args.run_dir}: no checkpoints to average")
    chosen = found[-args.last:]
    if len(chosen) < args.last:
        print(f"note: {args.run_dir} has only {len(chosen)} checkpoints; averaging those")
    path = checkpoint.average(chosen, args.out)
    print(f"averaged {', '.join(p.name for p in chosen)} -> {path}")
    return 0


def plot_command(args: argparse.Namespace) -> int:
    """One run: its loss and learning-rate curves. Several: their dev BLEU and dev loss
    against training minutes, on one figure."""
    from transduce.viz import plot_quality_over_time, plot_training

    if len(args.run_dirs) == 1:
        print(f"wrote {plot_training(args.run_dirs[0], args.out)}")
        return 0
    if args.out is None:
        raise ConfigError("plotting several runs needs --out FILE.png")
    print(f"wrote {plot_quality_over_time(args.run_dirs, args.out)}")
    return 0
