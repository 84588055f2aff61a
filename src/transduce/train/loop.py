"""The training loop: set up -> step -> log / evaluate / save, until the budget is spent.

It trains a translation model on a parallel corpus, or a language model (arch
"decoder") on a text corpus: lines batched by length as the target side of a pair, or
packed into fixed blocks (TrainConfig.pack_length). Everything else, the loss,
checkpoints, exact resume, averaging, EMA, processes, logs, is the same for both; dev
evaluation is loss and perplexity for both, and greedy BLEU for translation only.
An encoder (arch "encoder", BERT) pre-trains on a text corpus (masked LM, optionally
next-sentence prediction) or trains a classifier on labelled text, through the same
loop; train/encoder.py has its data, losses and dev evaluation.

One step = update_freq batches per process (gradients accumulated), all processes
together (torchrun; gloo on CPU, nccl on CUDA) averaging their gradients. The loss is
summed over target tokens and divided by the step's total target tokens across every
batch and process, so N processes with update_freq k train exactly like one process with
update_freq N * k.

train() changes nothing in the process that outlives it: SIGINT / SIGTERM handlers and
torch's thread count are put back when it returns (the global RNG is seeded, as any
training run must).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sacrebleu
import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from transduce import checkpoint
from transduce.config import ConfigError, ModelConfig, TrainConfig
from transduce.data.batching import (Batcher, EncoderBatcher, LineSpecials, PackedBatcher,
                                     TokenBatcher)
from transduce.data.corpus import CorpusKind, corpus_kind, has_split, language_pair
from transduce.data.dataset import TokenizedSplit, TokenizedText, load_split, load_text_split
from transduce.data.packing import PackedPairBatcher
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.data.tokenizer import MODEL_NAME, PAD_ID, TARGET_MODEL_NAME, TextTokenizer, \
    Tokenizer, TokenizerError, check_vocabularies
from transduce.decode.evaluate import score_lines
from transduce.decode.languages import Direction
from transduce.decode.translate import Translator
from transduce.errors import TransduceError
from transduce.model import Model, build_model, empty_model
from transduce.runtime import torch_threads, training_dtype
from transduce.train.distributed import (any_true, barrier, init_distributed,
                                         shutdown_distributed, sum_over_processes)
from transduce.train.flops import batch_training_flops, process_peak, training_flops
from transduce.train.log import TrainingLog, set_aside_earlier_log
from transduce.train.loss import projected_label_smoothed_nll
from transduce.train.ema import WeightAverage
from transduce.train.objective import SequenceObjective
from transduce.train.prefetch import BatchPrefetch
from transduce.train import encoder as encoder_training
from transduce.train import lora, sharding
from transduce.train.schedule import learning_rate
from transduce.train.languages import training_direction
from transduce.train.signals import StopRequest, stop_requests
from transduce.train.state import (BatchStream, Position, restore, save_training_checkpoint,
                                   save_weight_average)


class TrainingError(TransduceError, RuntimeError):
    """Training cannot go on (diverged, data does not fit); the message says why."""


@dataclass
class Run:
    """Everything a run needs from set-up to its last step."""

    out: Path
    model_config: ModelConfig
    train_config: TrainConfig
    world: int
    rank: int
    device: torch.device
    tokenizer: Tokenizer
    train_split: TokenizedSplit | TokenizedText | encoder_training.TokenizedLabelled
    dev_split: TokenizedSplit | TokenizedText | EncoderBatcher | encoder_training.DevQuestions \
        | None                   # an encoder's: batches (an answerer's: and its questions)
    batcher: Batcher
    model: Model
    net: torch.nn.Module          # the model as stepped: compiled, DDP-wrapped or sharded
    optimizer: torch.optim.Optimizer
    position: Position
    peak_flops: float
    log: TrainingLog
    ema: WeightAverage | None
    stream: BatchStream = field(init=False)
    prefetch: BatchPrefetch = field(init=False)   # the next batch, made during this step
    dtype: str = field(init=False)   # the training dtype, "auto" resolved for this device
    gradients_checked: bool = field(init=False, default=False)   # (--compile: once a run)

    def __post_init__(self) -> None:
        self.stream = BatchStream(self.batcher, self.position)
        self.prefetch = BatchPrefetch(self._collate, self.device)
        self.dtype = training_dtype(self.train_config.dtype, self.device)

    def _collate(self, key: tuple[int, int], indices: np.ndarray) -> tuple[object, float]:
        """A batch of training data on the host, and its training FLOPs."""
        weight_gradients = not self.train_config.lora_rank
        if self.encoder:
            batch = self.batcher.collate(indices, key)
            return batch, training_flops(self.model_config, *batch.ids.shape, 0,
                                         weight_gradients=weight_gradients)
        batch = self.batcher.collate(indices)
        return batch, batch_training_flops(self.model_config, batch,
                                           weight_gradients=weight_gradients)

    @property
    def main_process(self) -> bool:
        return self.rank == 0

    @property
    def language_model(self) -> bool:
        return is_language_model(self.model_config)

    @property
    def encoder(self) -> bool:
        return self.model_config.arch == "encoder"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.dtype == "bfloat16" else None


@dataclass
class StepResult:
    loss: float         # summed over the step's target tokens (label-smoothed)
    tokens: int         # target tokens of the step, over every process
    flops: float
    lr: float


def train(data_dir: Path, out: Path, model_config: ModelConfig, train_config: TrainConfig,
          *, resume: bool = False, init: Path | None = None) -> Path:
    """Train and return the last checkpoint's directory. resume: continue the run in
    `out` exactly; init: start from that checkpoint's weights (same model configuration)
    with a fresh optimizer."""
    with stop_requests() as stop, torch_threads(train_config.threads):
        world, rank = init_distributed()
        run, finished = None, False
        try:
            if resume:
                _refuse_spent_budget(out, train_config)
            run = set_up(data_dir, out, model_config, train_config, world, rank,
                         resume=resume, init=init)
            last = _train_until_done(run, stop)
            finished = True
            return last
        except BaseException as error:
            if world > 1:   # the frames it passed through hold the run, DDP's reducer
                traceback.clear_frames(error.__traceback__)
            raise
        finally:
            # Nothing may hold the process group when it is destroyed (DDP's reducer
            # does), or its gloo threads outlive train() into the interpreter's exit.
            run = None
            shutdown_distributed(world, finished)


def set_up(data_dir: Path, out: Path, model_config: ModelConfig, train_config: TrainConfig,
           world: int, rank: int, *, resume: bool, init: Path | None) -> Run:
    """Data, model, optimizer and position (restored when resuming), as the run starts."""
    check_run_configs(model_config, train_config, corpus_kind(data_dir), data_dir)
    lora.check_lora_run(model_config, train_config, init,
                        checkpoint.resolve(out) if resume else None)
    sharding.check_fsdp_config(model_config, train_config, world)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    check_cuda_graphs(train_config, world, device)
    lora.check_base_dtype(train_config, training_dtype(train_config.dtype, device))
    trained = checkpoint.list_checkpoints(out)[-1:] if resume else [init] if init else []
    tokenizer = _training_tokenizer(data_dir, trained[0] if trained else None, model_config)
    _check_vocabulary(model_config, tokenizer)
    codes = checkpoint.read_language_codes(checkpoint.resolve(trained[0])) \
        if trained and model_config.arch == "transformer" else None
    given = training_direction(codes, train_config)
    if model_config.arch == "encoder":
        train_split, batcher, dev_split = encoder_training.load_encoder_data(
            data_dir, tokenizer, model_config, train_config)
    else:
        train_split, dev_split, batcher = _load_data(data_dir, tokenizer, model_config,
                                                     train_config, given)

    labels = list(train_split.names) if isinstance(
        train_split, (encoder_training.TokenizedLabelled, encoder_training.TokenizedTagged,
                      encoder_training.TokenizedQuestions)) else None
    model = _initial_model(model_config, train_config, labels, init, resume, rank, device)
    if train_config.lora_rank:
        _add_adapters(model, train_config, out, init, device)
    if isinstance(train_split, encoder_training.TokenizedLabelled):   # what they label,
        model.classifier_inputs = "texts" if train_split.second_ids is None else "pairs"
    if model_config.arch not in ("encoder", "decoder"):
        # Checkpoints record the pair (a multilingual model's as its codes name it).
        model.languages = given.languages or language_pair(data_dir)
        model.language_codes = codes
    net = _stepped_module(model, model_config, train_config, world,
                          LineSpecials.of(tokenizer).loss_pad)
    # After sharding: FSDP replaces the parameters by their shards, which Adam steps.
    # A LoRA run's frozen weights have no gradient and no moments.
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.Adam(trained, lr=0.0,
                                 betas=(train_config.adam_beta1, train_config.adam_beta2),
                                 eps=train_config.adam_eps, fused=device.type in ("cpu", "cuda"))
    position, state = restore(out, model, optimizer, rank, device, world=world,
                              sharded=train_config.fsdp) if resume else (Position(), {})
    ema = WeightAverage(model, train_config.ema_decay) if train_config.ema_decay else None
    if ema is not None and "ema" in state:
        ema.load_state_dict(state["ema"])
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_stale_temporaries(out)
        earlier = None if resume else set_aside_earlier_log(out)
        if earlier is not None:
            print(f"note: {out} held the log of an earlier run that saved no checkpoint; "
                  f"it is now {earlier}")
    peak = process_peak(getattr(torch, training_dtype(train_config.dtype, device)), device)
    return Run(out, model_config, train_config, world, rank, device, tokenizer, train_split,
               dev_split, batcher, model, net, optimizer, position, peak,
               TrainingLog(out, rank == 0), ema)


def _initial_model(model_config: ModelConfig, train_config: TrainConfig,
                   labels: list[str] | None, init: Path | None, resume: bool, rank: int,
                   device: torch.device) -> Model:
    """The model as training starts: the same initial weights in every process, or
    those of `init`, or none yet when the run resumes (restore reads them all); then
    each process's own random stream (dropout differs)."""
    torch.manual_seed(train_config.seed)
    if resume or (init is not None and model_config.arch != "encoder"):   # read next
        model = empty_model(model_config, device)
    else:
        model = build_model(model_config).to(device)
    torch.manual_seed(train_config.seed + 1 + rank)
    if labels is not None:
        model.labels = labels     # checkpoints record the class names
    if init is not None and model_config.arch == "encoder":
        new = encoder_training.load_pretrained(model, init, device)
        if new and rank == 0:
            print(f"--init {init}: loaded every weight but the new classification head "
                  f"({', '.join(new)}), initialised afresh")
    elif init is not None:     # into place, without a second copy of the model
        checkpoint.load_weights(model, checkpoint.resolve(init), device)
    return model


def _add_adapters(model: Model, train_config: TrainConfig, out: Path, init: Path | None,
                  device: torch.device) -> None:
    """A LoRA run's adapters beside the weights of --init, or, when the run resumes, beside
    those of the checkpoint it started from, read again (restore reads the adapters)."""
    if init is None:
        init = lora.base_of_run(checkpoint.resolve(out))
        if model.config.arch == "encoder":   # every weight but a new head
            encoder_training.load_pretrained(model, init, device)
        else:
            checkpoint.load_weights(model, checkpoint.resolve(init), device)
    lora.adapt(model, train_config, checkpoint.resolve(init))


def _stepped_module(model: Model, model_config: ModelConfig, train_config: TrainConfig,
                    world: int, pad_id: int | None) -> torch.nn.Module:
    """What a step runs: the model and its loss as one module (train/objective.py;
    an encoder's objective around the model), compiled if asked, and across processes
    DistributedDataParallel around that, or (fsdp) the same sharded in place. pad_id:
    the loss's (LineSpecials.loss_pad)."""
    # Packed rows give every batch one shape: compiled for it alone (dynamic shapes
    # would trade specialised kernels for shapes that never come).
    dynamic = not train_config.pack_length
    net: torch.nn.Module
    if model_config.arch == "encoder":   # the layers and the heads a step uses, as one
        net = encoder_training.EncoderObjective(
            torch.compile(model, dynamic=dynamic) if train_config.compile else model)
    else:   # compiled with its loss: one graph a step, with no pause for the host
        net = SequenceObjective(model, is_language_model(model_config),
                                train_config.label_smoothing, pad_id)
        if train_config.cuda_graphs:   # torch.compile's CUDA graphs: one launch a graph
            net = torch.compile(net, dynamic=False, mode="reduce-overhead")
        elif train_config.compile:
            net = torch.compile(net, dynamic=dynamic)
    if train_config.fsdp:
        sharding.shard(net, model)
    elif world > 1:
        if model_config.arch == "encoder":
            # The heads the objective never runs are left out of DDP, so that every
            # parameter it averages gets a gradient in every step.
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                net, encoder_training.unused_parameter_names(net, model, train_config))
        # The buffers are constants every process builds alike (position tables, a LoRA
        # run's quantized frozen weights): sending rank 0's before each step would copy
        # the frozen weights over the network every step for nothing.
        net = DistributedDataParallel(net, broadcast_buffers=False)
    return net


def _training_tokenizer(data_dir: Path, weights_from: Path | None,
                        model_config: ModelConfig) -> TextTokenizer:
    """The vocabulary the run reads: an imported checkpoint's own tokenizer (a
    tokenizer.json: BERT's WordPiece, RoBERTa's or GPT-2's BPE, Llama's) when it trains on
    from one, whatever the corpus holds, as its embeddings know no other; else a
    SentencePiece model (_tokenizer_path)."""
    if weights_from is not None:
        directory = checkpoint.resolve(weights_from)
        if checkpoint.holds_tokenizer_json(directory):
            if model_config.arch not in ("encoder", "decoder"):
                raise TrainingError(
                    f"{directory}: its vocabulary is a tokenizer.json (an imported "
                    f"checkpoint's); encoders (BERT, RoBERTa, DistilBERT) and language "
                    f"models (GPT-2, Llama) train on one here, a {model_config.arch!r} model "
                    f"trains on a SentencePiece vocabulary")
            return checkpoint.load_tokenizer(directory)
    return Tokenizer(_tokenizer_path(data_dir, weights_from))


def _tokenizer_path(data_dir: Path, weights_from: Path | None) -> Path:
    """The corpus's vocabulary; a model trained on from a checkpoint (weights_from:
    --init's, an encoder into a classifier or an imported translation model on a corpus
    of one's own, or the run's latest when it resumes) on a corpus without one reads the
    checkpoint's, which its embeddings were trained on (and its targets' segmentation,
    data/tokenizer.py)."""
    path = data_dir / MODEL_NAME
    if weights_from is None:
        return path
    theirs = checkpoint.resolve(weights_from) / MODEL_NAME
    if not theirs.is_file():
        return path
    if not path.is_file():
        return theirs
    for name in (MODEL_NAME, TARGET_MODEL_NAME):    # a separate target vocabulary too
        ours, stored = data_dir / name, theirs.with_name(name)
        if ours.is_file() and (not stored.is_file() or stored.read_bytes() != ours.read_bytes()):
            raise TrainingError(f"{ours} is not the vocabulary {weights_from} was trained "
                                f"with ({stored}): remove it to train on with the "
                                f"checkpoint's")
    return theirs      # the same, with the targets' segmentation if it has one of its own


def _check_vocabulary(model_config: ModelConfig, tokenizer: TextTokenizer) -> None:
    if isinstance(tokenizer, HFTokenizer):   # an import may have embeddings to spare
        field = "tgt_vocab_size" if model_config.arch == "decoder" else "src_vocab_size"
        if tokenizer.vocab_size > getattr(model_config, field):
            raise TrainingError(f"{tokenizer.path}: {tokenizer.vocab_size} tokens, but the "
                                f"model has {field}={getattr(model_config, field)}")
        if model_config.pad_id != tokenizer.pad_id:
            raise TrainingError(f"ModelConfig.pad_id={model_config.pad_id} is not the pad id "
                                f"of {tokenizer.path} ({tokenizer.pad_id})")
        return
    try:
        check_vocabularies(tokenizer, model_config.src_vocab_size,
                           model_config.tgt_vocab_size, model_config.shares_embeddings)
    except TokenizerError as error:
        raise TrainingError(str(error)) from None
    if model_config.pad_id != PAD_ID:
        raise TrainingError(f"ModelConfig.pad_id must be the tokenizer's pad id {PAD_ID}")


def is_language_model(model_config: ModelConfig) -> bool:
    return model_config.arch == "decoder"


def check_cuda_graphs(train_config: TrainConfig, world: int, device: torch.device) -> None:
    """What TrainConfig cannot check alone: a GPU and one process. (The architectures
    that cannot pack are refused their pack_length by check_run_configs.)"""
    if not train_config.cuda_graphs:
        return
    if device.type != "cuda":
        raise ConfigError("TrainConfig.cuda_graphs replays steps on a CUDA GPU, and this "
                          "machine has none; pass --no-cuda-graphs")
    if world > 1:
        raise ConfigError("TrainConfig.cuda_graphs trains in one process here (DDP's "
                          "gradient hooks run between the graphs); pass --no-cuda-graphs "
                          "or start one process")


def check_run_configs(model_config: ModelConfig, train_config: TrainConfig, kind: CorpusKind,
                      data_dir: Path) -> None:
    """Refuse what cannot train, before anything is loaded or written: a model on the
    other kind of corpus, BLEU for a language model, packing what cannot be packed."""
    encoder_training.check_encoder_configs(model_config, train_config, kind, data_dir)
    if model_config.arch == "encoder":
        return
    language_model = is_language_model(model_config)
    if language_model and kind != "text":
        raise ConfigError(f"arch 'decoder' is a language model: --data {data_dir} is a "
                          f"parallel corpus; give a text corpus (train.txt, dev.txt; "
                          f"`transduce data bible-text`)")
    if not language_model and kind == "text":
        raise ConfigError(f"--data {data_dir} is a text corpus, with no source side for "
                          f"arch {model_config.arch!r}; train a language model on it "
                          f"(--arch decoder)")
    if language_model and train_config.dev_bleu_sentences:
        raise ConfigError(f"TrainConfig.dev_bleu_sentences={train_config.dev_bleu_sentences}: "
                          f"a language model translates nothing to score; its dev "
                          f"evaluation is dev_loss and dev_ppl (per piece). Set it to 0")
    if train_config.pack_length and model_config.arch != "transformer" and not language_model:
        raise ConfigError(f"TrainConfig.pack_length={train_config.pack_length} packs lines "
                          f"(arch 'decoder') or pairs (arch 'transformer'), not arch "
                          f"{model_config.arch!r}")
    if train_config.pack_length and not language_model and \
            model_config.attention_type != "softmax":
        raise ConfigError(f"TrainConfig.pack_length={train_config.pack_length}: packed pairs "
                          f"keep to themselves through softmax attention's masks, not "
                          f"attention_type={model_config.attention_type!r}")
    if train_config.pack_length > model_config.max_positions:
        raise ConfigError(f"TrainConfig.pack_length={train_config.pack_length}: the model "
                          f"reads at most max_positions={model_config.max_positions} tokens")
    if train_config.pack_length > train_config.max_tokens:
        raise ConfigError(f"TrainConfig.pack_length={train_config.pack_length}: a batch of "
                          f"max_tokens={train_config.max_tokens} holds max_tokens // "
                          f"pack_length blocks, none at this length")


def _load_data(data_dir: Path, tokenizer: Tokenizer, model_config: ModelConfig,
               train_config: TrainConfig, given: Direction = Direction()
               ) -> tuple[TokenizedSplit | TokenizedText, TokenizedSplit | TokenizedText | None,
                          Batcher]:
    """-> (train split, dev split or None, train batcher). Lines and pairs longer than
    max_len (and the model's positions, less the tokens `given` to a multilingual
    model's pairs) are filtered, and packed pairs longer than a row; a language model's
    packed blocks hold pieces of lines of any length."""
    c = train_config
    max_len = min(c.max_len, model_config.max_positions - len(given.forced))
    if not is_language_model(model_config):
        # A packed row holds a sentence and its eos (or bos): pack_length - 1 pieces.
        train_split = load_split(data_dir, "train", tokenizer,
                                 min(max_len, c.pack_length - 1) if c.pack_length else max_len)
        batcher: Batcher = PackedPairBatcher(
            train_split.src_ids, train_split.tgt_ids, c.pack_length, c.max_tokens,
            seed=c.seed, line_numbers=train_split.line_numbers) if c.pack_length else \
            TokenBatcher(train_split.src_ids, train_split.tgt_ids, c.max_tokens,
                         seed=c.seed, line_numbers=train_split.line_numbers,
                         source_prefix=given.source_prefix, forced=given.forced)
        if c.pack_length:
            train_split.report.append(f"pairs packed into rows of {c.pack_length} tokens a "
                                      f"side, {c.max_tokens // c.pack_length} rows per batch")
        dev_split = load_split(data_dir, "dev", tokenizer, max_len) \
            if has_split(data_dir, "dev") else None
        return train_split, dev_split, batcher
    train_text = load_text_split(data_dir, "train", tokenizer,
                                 None if c.pack_length else max_len)
    specials = LineSpecials.of(tokenizer)
    if c.pack_length:
        batcher = PackedBatcher(train_text.ids, c.pack_length, c.max_tokens, seed=c.seed,
                                specials=specials)
        train_text.report.append(f"packed into {batcher.num_blocks} blocks of {c.pack_length} "
                                 f"tokens, {batcher.blocks_per_batch} per batch")
    else:
        batcher = TokenBatcher(None, train_text.ids, c.max_tokens, seed=c.seed,
                               line_numbers=train_text.line_numbers, specials=specials)
    dev_text = load_text_split(data_dir, "dev", tokenizer, max_len) \
        if has_split(data_dir, "dev") else None
    return train_text, dev_text, batcher


def _train_until_done(run: Run, stop: StopRequest) -> Path:
    """Steps until the step or time budget is spent or a signal asks to stop; logs,
    evaluates and saves along the way. -> the last checkpoint."""
    _announce(run)
    started = time.perf_counter()
    progress = tqdm(total=run.train_config.max_steps or None, initial=run.position.step,
                    disable=not run.main_process, unit="step", dynamic_ncols=True)
    window = _Window()
    nonfinite_in_a_row, forecast_due = 0, bool(run.train_config.max_minutes)
    first_step = run.position.step
    while True:
        step_start = time.perf_counter()
        result = train_step(run, run.position.seconds + step_start - started)
        if result is None:
            nonfinite_in_a_row += 1
            _refuse_divergence(run, nonfinite_in_a_row)
            continue
        nonfinite_in_a_row = 0
        run.position.step += 1
        run.position.tokens += result.tokens
        progress.update(1)
        window.add(result, time.perf_counter() - step_start)
        elapsed = time.perf_counter() - started
        if forecast_due and elapsed >= FORECAST_AFTER_S:
            forecast_due = False
            _forecast(run, run.position.step - first_step, elapsed, progress)
        budget = _budget_spent(run.train_config, run.position, elapsed)
        finished = any_true(bool(budget or stop.received), run.world, run.device)
        saved = _periodic(run, window, result.lr, elapsed, finished, progress)
        if finished:
            break
    progress.close()
    if run.main_process:
        reason = stop.received or budget or "another process was stopped"
        print(f"stopped after step {run.position.step} ({reason}); last checkpoint {saved}")
        if run.ema is not None:
            ema = save_weight_average(run.out, run.model, run.ema, run.train_config,
                                      run.tokenizer, run.position.step)
            print(f"moving average of the weights (decay {run.ema.decay}): {ema}")
    return saved


FORECAST_AFTER_S = 60.0


def _forecast(run: Run, steps: int, elapsed: float, progress: tqdm) -> None:
    """After the first minute (`steps` steps in `elapsed` seconds of this process): how many
    steps the whole time budget will give at this pace."""
    minutes = run.train_config.max_minutes
    left = max(0.0, 60 * minutes - run.position.seconds - elapsed)
    expected = round(run.position.step + steps / elapsed * left)
    if run.main_process:
        progress.write(f"after {elapsed:.0f} s: step {run.position.step}; at this pace about "
                       f"{expected:,d} steps in {minutes:g} minutes")
    run.log.write({"event": "forecast", "step": run.position.step, "elapsed_s": elapsed,
                   "expected_steps": expected})


def train_step(run: Run, seconds: float) -> StepResult | None:
    """One optimizer step over update_freq batches per process, `seconds` into the run;
    None (and no update) when the loss is not finite."""
    c = run.train_config
    keyed = run.stream.take_keyed(run.world * c.update_freq)
    batches = [indices for _, indices in keyed]
    mine = keyed[run.rank * c.update_freq:(run.rank + 1) * c.update_freq]
    step_tokens = sum(run.batcher.target_tokens(indices) for indices in batches)
    counts = encoder_training.step_counts(run.batcher, batches) if run.encoder else {}
    run.model.train()
    losses, flops = [], 0.0
    for i, (key, indices) in enumerate(mine):
        last = i == len(mine) - 1
        sync = _gradient_sync(run, last)
        with sync, torch.autocast(run.device.type, dtype=run.autocast_dtype or torch.float32,
                                  enabled=run.autocast_dtype is not None):
            loss, batch_flops = _backward(run, key, indices, step_tokens, counts)
        losses.append(loss)
        flops += batch_flops
        # On a GPU this batch's passes are queued, not yet run: the next batch is made
        # meanwhile.
        run.prefetch.prepare(*(mine[i + 1] if not last else _first_of_next_step(run)))
    loss_sum = _wait_for_losses(losses)
    loss_sum, flops = sum_over_processes([loss_sum, flops], run.world, run.device)
    if not math.isfinite(loss_sum):
        run.optimizer.zero_grad(set_to_none=True)
        run.log.write({"event": "nonfinite_loss", "step": run.position.step + 1, "loss": loss_sum})
        return None
    if c.compile and not run.gradients_checked:
        refuse_lost_gradients(run.model, run.world, run.device)
        run.gradients_checked = True
    if c.clip_norm > 0:
        _clip_gradients(run, c.clip_norm)
    if c.schedule == "budget" and run.world > 1:   # one clock for all: the same rate everywhere
        seconds = sum_over_processes([seconds], run.world, run.device)[0] / run.world
    lr = learning_rate(c, run.model_config.d_model, run.position.step, seconds)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema is not None:
        run.ema.update(run.model)
    return StepResult(loss_sum, step_tokens, flops, lr)


def _wait_for_losses(losses: list[Tensor]) -> float:
    """The step's batches' losses summed on the host: waits for the step's backward."""
    return sum(loss.item() for loss in losses)


def _first_of_next_step(run: Run) -> tuple[tuple[int, int], np.ndarray]:
    """(key, indices) of this process's first batch in the next step."""
    return run.stream.peek_keyed(run.rank * run.train_config.update_freq + 1)[-1]


def refuse_lost_gradients(model: torch.nn.Module, world: int, device: torch.device) -> None:
    """A compiled run's first step must leave some gradient that is not zero: under
    torch 2.11 the compiled loss once handed the backward pass zeros (train/loss.py),
    and the run trained nothing without a word. Checked once a run (a host sync)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP's shards
    moved = any(bool(g.count_nonzero()) for g in local)
    if not any_true(moved, world, device):
        raise TrainingError("--compile: every gradient of the first step is zero: this "
                            "torch's compiler lost them, and the run would train nothing; "
                            "train without --compile, or with another version of torch")


def _gradient_sync(run: Run, last: bool) -> contextlib.AbstractContextManager:
    """Processes average gradients on a step's last batch only: before it, they
    accumulate in each process (DDP's no_sync, FSDP's set_requires_gradient_sync)."""
    if run.world == 1 or last:
        return contextlib.nullcontext()
    if run.train_config.fsdp:
        return sharding.gradient_sync(run.net, False)
    return run.net.no_sync()


def _clip_gradients(run: Run, max_norm: float) -> None:
    if run.train_config.fsdp:   # each process holds a shard of every gradient
        sharding.clip_gradients(list(run.model.parameters()), max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_norm)


def _backward(run: Run, key: tuple[int, int], indices: np.ndarray, step_tokens: int,
              counts: dict[str, int]) -> tuple[Tensor, float]:
    """One batch's forward and backward; its gradients are this batch's share of the
    step's mean loss. -> (its loss summed over its scored tokens, a 0-d tensor left on
    the device; its FLOPs)."""
    batch, flops = run.prefetch.take(key, indices)
    if run.encoder:
        share = encoder_training.step_objective(run.net(batch), counts)
        (share * run.world).backward()
        # Logged per scored token: the step's loss (a sum of means) x its tokens.
        return (share * step_tokens).detach(), flops
    if run.train_config.cuda_graphs:   # the last step's graph outputs are read no more
        torch.compiler.cudagraph_mark_step_begin()
    loss = run.net(batch.src, batch.tgt_in, batch.tgt_out, batch.segments)
    # DDP averages over processes: scale so the result is sum / step_tokens.
    (loss * run.world / step_tokens).backward()
    return loss.detach(), flops


def _refuse_divergence(run: Run, nonfinite_in_a_row: int) -> None:
    if nonfinite_in_a_row >= run.train_config.nan_limit:
        raise TrainingError(f"the loss was not finite in {nonfinite_in_a_row} steps in a "
                            f"row (last at step {run.position.step + 1}); lower lr_scale, "
                            f"raise warmup_steps or set clip_norm")


def _budget_spent(c: TrainConfig, position: Position, elapsed: float) -> str | None:
    """Which budget the run has spent, if any. Both count the whole run, a resumed one
    included: its steps, and its training time before and in this process."""
    if c.max_minutes and position.seconds + elapsed >= 60 * c.max_minutes:
        return "time budget"
    if c.max_steps and position.step >= c.max_steps:
        return "step budget"
    return None


def _refuse_spent_budget(out: Path, c: TrainConfig) -> None:
    """A resume whose latest checkpoint has spent the budget is refused before the data
    and the model are loaded (its trainer state mapped, not read)."""
    latest = checkpoint.resolve(out)
    at = Position(**checkpoint.load_trainer_state(latest, mmap=True)["position"])
    spent = _budget_spent(c, at, 0.0)
    if spent:
        done, budget = (f"is at step {at.step}", f"max_steps={c.max_steps}") \
            if spent == "step budget" else \
            (f"has trained {at.seconds / 60:.1f} minutes", f"max_minutes={c.max_minutes:g}")
        raise TrainingError(f"{out}: the run {done}, which spends its {spent} "
                            f"({budget}); raise it to train on")


@dataclass
class _Window:
    """Sums since the last log record."""

    loss: float = 0.0
    tokens: int = 0
    flops: float = 0.0
    seconds: float = 0.0

    def add(self, result: StepResult, seconds: float) -> None:
        self.loss += result.loss
        self.tokens += result.tokens
        self.flops += result.flops
        self.seconds += seconds

    def reset(self) -> None:
        self.loss, self.tokens, self.flops, self.seconds = 0.0, 0, 0.0, 0.0


def _periodic(run: Run, window: _Window, lr: float, elapsed: float, finished: bool,
              progress: tqdm) -> Path | None:
    """Log, evaluate on dev and save when their period comes (and at the end).
    -> the checkpoint saved now, if any."""
    c, step = run.train_config, run.position.step
    if step % c.log_every == 0 or finished:
        _log_window(run, window, lr, elapsed, progress)
        window.reset()
    if run.dev_split is not None and (step % c.eval_every == 0 or finished):
        model = _evaluated_model(run)
        if run.main_process and isinstance(run.dev_split, (
                EncoderBatcher, encoder_training.DevQuestions)):
            result = encoder_training.evaluate_encoder(model, run.dev_split, run.device)
        elif run.main_process:
            result = evaluate_dev(model, run.dev_split, run.tokenizer, c, run.device)
        if run.main_process:
            run.log.write({"event": "dev", "step": step,
                           "elapsed_s": run.position.seconds + elapsed, **result})
            progress.write(f"step {step}: " + ", ".join(f"{key} {value:.3f}"
                                                        for key, value in result.items()))
        barrier(run.world)
    if step % c.save_every == 0 or finished:
        return save_training_checkpoint(run.out, run.model, c, run.tokenizer, run.optimizer,
                                        run.position, elapsed, run.world, run.rank, run.ema,
                                        sharded=c.fsdp)
    return None


def _evaluated_model(run: Run) -> Model | None:
    """The model the first process evaluates: a sharded one's weights are gathered into
    an unsharded copy on the device (every process takes part; the others get None)."""
    if not run.train_config.fsdp:
        return run.model
    model = sharding.gather_model(run.model, run.main_process)
    return None if model is None else model.to(run.device)


def _log_window(run: Run, window: _Window, lr: float, elapsed: float, progress: tqdm) -> None:
    record = {"event": "train", "step": run.position.step, "epoch": run.position.epoch,
              "loss": window.loss / max(window.tokens, 1), "lr": lr,
              "tokens_per_s": window.tokens / window.seconds,
              "mfu": window.flops / window.seconds / run.peak_flops,
              "elapsed_s": run.position.seconds + elapsed}
    run.log.write(record)
    minutes = run.train_config.max_minutes
    left = {"left": f"{minutes - elapsed / 60:.1f}min"} if minutes else {}
    progress.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}",
                         tok_s=f"{record['tokens_per_s']:.0f}", mfu=f"{100 * record['mfu']:.1f}%",
                         **left)


def _announce(run: Run) -> None:
    """What is about to train, printed and logged by the first process."""
    if not run.main_process:
        return
    c = run.train_config
    for line in run.train_split.report:
        print(line)
    print(f"model: {run.model.num_parameters():,d} parameters; "
          f"{len(run.batcher.epoch_batches(0))} batches of <= {c.max_tokens} tokens per epoch, "
          f"padding {100 * run.batcher.padding_fraction(0):.1f}%; {run.world} process(es) x "
          f"update_freq {c.update_freq}; matmul peak {run.peak_flops / 1e9:.0f} GFLOP/s "
          f"({run.dtype}{', auto' if c.dtype == 'auto' else ''})")
    if c.lora_rank:
        trained = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        share = 100 * trained / run.model.num_parameters()
        print(f"LoRA: rank {c.lora_rank}, alpha {c.lora_alpha:g} on {c.lora_targets}: "
              f"{trained:,d} parameters trained ({share:.2f}%), the rest frozen")
    run.log.write({"event": "start", "step": run.position.step,
                   "parameters": run.model.num_parameters(), "world_size": run.world,
                   "peak_flops": run.peak_flops, "model": run.model_config.to_dict(),
                   "train": c.to_dict(), "dtype": run.dtype})


def evaluate_dev(model: Model, split: TokenizedSplit | TokenizedText, tokenizer: Tokenizer,
                 train_config: TrainConfig, device: torch.device) -> dict[str, float]:
    """Dev loss and perplexity per piece (no label smoothing), and greedy BLEU if asked
    for (translation only). A language model's dev lines are scored each on its own,
    whichever layout trained it, as `transduce evaluate` scores them."""
    if isinstance(split, TokenizedText):
        loss = score_lines(model, split.ids, max_tokens=train_config.max_tokens,
                           device=device, bos_id=tokenizer.bos_id,
                           eos_id=tokenizer.eos_id).loss
        model.train()
        return {"dev_loss": loss, "dev_ppl": math.exp(min(loss, 50.0))}
    model.eval()
    given = training_direction(getattr(model, "language_codes", None), train_config)
    batcher = TokenBatcher(split.src_ids, split.tgt_ids, train_config.max_tokens, shuffle=False,
                           source_prefix=given.source_prefix, forced=given.forced)
    nll_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batcher.iterate(epoch=0):
            batch = batch.to(device)
            _, nll = projected_label_smoothed_nll(model(batch.src, batch.tgt_in, project=False),
                                                  model.output_proj.weight, batch.tgt_out,
                                                  0.0, PAD_ID, bias=model.output_proj.bias)
            nll_sum += nll.item()
            tokens += batch.num_tgt_tokens
    result = {"dev_loss": nll_sum / tokens, "dev_ppl": math.exp(min(nll_sum / tokens, 50.0))}
    count = train_config.dev_bleu_sentences
    if count:
        # Beam 1 is greedy search (tested); Translator batches, pads and detokenises.
        source, target = given.languages or (None, None)
        hypotheses = Translator(model, tokenizer, device).translate(
            split.corpus.source[:count], beam=1, source_lang=source, target_lang=target)
        result["dev_bleu_greedy"] = sacrebleu.corpus_bleu(
            hypotheses, [split.corpus.target[:count]]).score
    model.train()
    return result
