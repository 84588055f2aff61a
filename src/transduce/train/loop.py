"""The training loop: setup -> step -> evaluate -> checkpoint, until the budget is spent.

One step = update_freq batches per process (gradients accumulated), all processes
together (torchrun; gloo on CPU, nccl on CUDA) averaging their gradients. The loss is
summed over target tokens and divided by the step's total target tokens across every
batch and process, so N processes with update_freq k train exactly like one process with
update_freq N * k.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sacrebleu
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from transduce.config import ModelConfig, TrainConfig
from transduce.data.batching import TokenBatcher
from transduce.data.dataset import load_split
from transduce.data.tokenizer import MODEL_NAME, PAD_ID, Tokenizer
from transduce.decode.translate import Translator
from transduce.model import Seq2SeqModel, build_model
from transduce.runtime import keep_freed_memory
from transduce.train import checkpoint
from transduce.train.flops import matmul_peak, training_flops
from transduce.train.loss import label_smoothed_nll
from transduce.train.schedule import noam_lr

LOG = "log.jsonl"


class TrainingError(RuntimeError):
    """Training cannot go on (diverged, data does not fit); the message says why."""


@dataclass
class Position:
    """Where the run stands: what resuming needs besides weights and optimizer."""

    step: int = 0
    epoch: int = 0
    batch: int = 0          # batches of `epoch` already consumed
    tokens: int = 0         # target tokens trained on
    seconds: float = 0.0    # training time before this process started


class BatchStream:
    """The batches of epoch after epoch, deterministic from (seed, epoch, batch)."""

    def __init__(self, batcher: TokenBatcher, position: Position):
        self.batcher, self.position = batcher, position
        self._epoch_batches = batcher.epoch_batches(position.epoch)

    def take(self, count: int) -> list[np.ndarray]:
        taken = []
        while len(taken) < count:
            if self.position.batch >= len(self._epoch_batches):
                self.position.epoch += 1
                self.position.batch = 0
                self._epoch_batches = self.batcher.epoch_batches(self.position.epoch)
            taken.append(self._epoch_batches[self.position.batch])
            self.position.batch += 1
        return taken


class _StopSignal:
    """SIGINT / SIGTERM ask the loop to save a final checkpoint and stop."""

    def __init__(self) -> None:
        self.received: str | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, number, frame) -> None:
        self.received = signal.Signals(number).name


def train(data_dir: Path, out: Path, model_config: ModelConfig, train_config: TrainConfig,
          *, resume: bool = False, init: Path | None = None) -> Path:
    """Train and return the last checkpoint's directory. init: start from that
    checkpoint's weights (same model configuration) with a fresh optimizer."""
    world, rank = _init_distributed()
    keep_freed_memory()
    main_process = rank == 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    if train_config.threads:
        torch.set_num_threads(train_config.threads)

    tokenizer = Tokenizer(data_dir / MODEL_NAME)
    for field in ("src_vocab_size", "tgt_vocab_size"):
        if getattr(model_config, field) != tokenizer.vocab_size:
            raise TrainingError(f"ModelConfig.{field}={getattr(model_config, field)} but the "
                                f"vocabulary {tokenizer.path} has {tokenizer.vocab_size} pieces")
    if model_config.pad_id != PAD_ID:
        raise TrainingError(f"ModelConfig.pad_id must be the tokenizer's pad id {PAD_ID}")
    max_len = min(train_config.max_len, model_config.max_positions)
    train_split = load_split(data_dir, "train", tokenizer, max_len)
    batcher = TokenBatcher(train_split.src_ids, train_split.tgt_ids, train_config.max_tokens,
                           seed=train_config.seed, line_numbers=train_split.line_numbers)
    dev_split = load_split(data_dir, "dev", tokenizer, max_len) \
        if (data_dir / "corpus.json").is_file() and _has_split(data_dir, "dev") else None

    position = Position()
    torch.manual_seed(train_config.seed)  # the same initial weights in every process
    model = build_model(model_config).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0,
                                 betas=(train_config.adam_beta1, train_config.adam_beta2),
                                 eps=train_config.adam_eps)
    torch.manual_seed(train_config.seed + 1 + rank)  # dropout differs across processes
    if init is not None:
        model.load_state_dict(checkpoint.load_model_from(init, device).state_dict())
    if resume:
        position = _restore(out, model, optimizer, rank, device)
    elif main_process:
        out.mkdir(parents=True, exist_ok=True)
    if main_process:
        checkpoint.remove_stale_temporaries(out)

    net: torch.nn.Module = torch.compile(model, dynamic=True) if train_config.compile else model
    if world > 1:
        net = DistributedDataParallel(net)
    autocast_dtype = torch.bfloat16 if train_config.dtype == "bfloat16" else None
    peak = matmul_peak(autocast_dtype or torch.float32, device)
    stream = BatchStream(batcher, position)
    stop = _StopSignal()
    log = _Log(out / LOG, main_process)
    if main_process:
        for line in train_split.report:
            print(line)
        print(f"model: {model.num_parameters():,d} parameters; {len(batcher.epoch_batches(0))} "
              f"batches of <= {train_config.max_tokens} tokens per epoch, padding "
              f"{100 * batcher.padding_fraction(0):.1f}%; {world} process(es) x update_freq "
              f"{train_config.update_freq}; matmul peak {peak / 1e9:.0f} GFLOP/s "
              f"({train_config.dtype})")
        log.write({"event": "start", "step": position.step, "parameters": model.num_parameters(),
                   "world_size": world, "peak_flops": peak, "model": model_config.to_dict(),
                   "train": train_config.to_dict()})

    started = time.perf_counter()
    progress = tqdm(total=train_config.max_steps or None, initial=position.step,
                    disable=not main_process, unit="step", dynamic_ncols=True)
    window = {"loss": 0.0, "tokens": 0, "flops": 0.0, "seconds": 0.0}
    nonfinite_in_a_row = 0
    while True:
        step_start = time.perf_counter()
        batches = stream.take(world * train_config.update_freq)
        mine = batches[rank * train_config.update_freq:(rank + 1) * train_config.update_freq]
        step_tokens = int(sum(batcher.tgt_lengths[indices].sum() for indices in batches))
        model.train()
        loss_sum, flops = 0.0, 0.0
        for i, indices in enumerate(mine):
            batch = batcher.collate(indices).to(device)
            last = i == len(mine) - 1
            sync = contextlib.nullcontext() if world == 1 or last else net.no_sync()
            with sync, torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                                      enabled=autocast_dtype is not None):
                logits = net(batch.src, batch.tgt_in)
                loss, _ = label_smoothed_nll(logits, batch.tgt_out, train_config.label_smoothing,
                                             PAD_ID)
                # DDP averages over processes: scale so the result is sum / step_tokens.
                (loss * world / step_tokens).backward()
            loss_sum += loss.item()
            flops += training_flops(model_config, *batch.src.shape, batch.tgt_in.shape[1])
        loss_sum, flops = _sum_over_processes([loss_sum, flops], world, device)
        if not math.isfinite(loss_sum):
            optimizer.zero_grad(set_to_none=True)
            nonfinite_in_a_row += 1
            log.write({"event": "nonfinite_loss", "step": position.step + 1, "loss": loss_sum})
            if nonfinite_in_a_row >= train_config.nan_limit:
                raise TrainingError(f"the loss was not finite in {nonfinite_in_a_row} steps in a "
                                    f"row (last at step {position.step + 1}); lower lr_scale, "
                                    f"raise warmup_steps or set clip_norm")
            continue
        nonfinite_in_a_row = 0
        if train_config.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.clip_norm)
        lr = noam_lr(train_config.schedule_offset + position.step + 1, model_config.d_model,
                     train_config.warmup_steps, train_config.lr_scale)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        position.step += 1
        position.tokens += step_tokens
        progress.update(1)

        seconds = time.perf_counter() - step_start
        window["loss"] += loss_sum
        window["tokens"] += step_tokens
        window["flops"] += flops
        window["seconds"] += seconds
        elapsed = time.perf_counter() - started
        out_of_time = train_config.max_minutes and elapsed >= 60 * train_config.max_minutes
        out_of_steps = train_config.max_steps and position.step >= train_config.max_steps
        finished = _any_true(bool(out_of_time or out_of_steps or stop.received), world, device)

        if position.step % train_config.log_every == 0 or finished:
            record = {"event": "train", "step": position.step, "epoch": position.epoch,
                      "loss": window["loss"] / max(window["tokens"], 1), "lr": lr,
                      "tokens_per_s": window["tokens"] / window["seconds"],
                      "mfu": window["flops"] / window["seconds"] / peak,
                      "elapsed_s": position.seconds + elapsed}
            log.write(record)
            remaining = 60 * train_config.max_minutes - elapsed if train_config.max_minutes else None
            progress.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}",
                                 tok_s=f"{record['tokens_per_s']:.0f}",
                                 mfu=f"{100 * record['mfu']:.1f}%",
                                 **({"left": f"{remaining / 60:.1f}min"} if remaining else {}))
            window = {key: 0.0 if key != "tokens" else 0 for key in window}
        if dev_split is not None and (position.step % train_config.eval_every == 0 or finished):
            if main_process:
                result = evaluate_dev(model, dev_split, tokenizer, train_config, device)
                log.write({"event": "dev", "step": position.step, **result})
                progress.write(f"step {position.step}: " + ", ".join(
                    f"{key} {value:.3f}" for key, value in result.items()))
            _barrier(world)
        if position.step % train_config.save_every == 0 or finished:
            saved = _save(out, model, train_config, tokenizer, optimizer, position,
                          elapsed, world, rank)
        if finished:
            break
    progress.close()
    if main_process:
        reason = stop.received or ("time budget" if out_of_time else "step budget")
        print(f"stopped after step {position.step} ({reason}); last checkpoint {saved}")
    _shutdown_distributed(world)
    return saved


def evaluate_dev(model: Seq2SeqModel, split, tokenizer: Tokenizer, train_config: TrainConfig,
                 device: torch.device) -> dict[str, float]:
    """Dev loss and perplexity (no label smoothing), and greedy BLEU if asked for."""
    model.eval()
    batcher = TokenBatcher(split.src_ids, split.tgt_ids, train_config.max_tokens, shuffle=False)
    nll_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batcher.iterate(epoch=0):
            batch = batch.to(device)
            _, nll = label_smoothed_nll(model(batch.src, batch.tgt_in), batch.tgt_out, 0.0, PAD_ID)
            nll_sum += nll.item()
            tokens += batch.num_tgt_tokens
    result = {"dev_loss": nll_sum / tokens, "dev_ppl": math.exp(min(nll_sum / tokens, 50.0))}
    count = train_config.dev_bleu_sentences
    if count:
        # Beam 1 is greedy search (tested); Translator batches, pads and detokenises.
        hypotheses = Translator(model, tokenizer, device).translate(
            split.corpus.source[:count], beam=1)
        result["dev_bleu_greedy"] = sacrebleu.corpus_bleu(
            hypotheses, [split.corpus.target[:count]]).score
    model.train()
    return result


def _has_split(data_dir: Path, split: str) -> bool:
    from transduce.data.corpus import split_files

    return all(path.is_file() for path in split_files(data_dir, split))


def _save(out: Path, model: Seq2SeqModel, train_config: TrainConfig, tokenizer: Tokenizer,
          optimizer: torch.optim.Optimizer, position: Position, elapsed: float,
          world: int, rank: int) -> Path:
    rng = {"torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    all_rng = [rng]
    if world > 1:
        all_rng = [None] * world
        dist.all_gather_object(all_rng, rng)
    path = checkpoint.step_dir(out, position.step)
    if rank == 0:
        state = {"position": {"step": position.step, "epoch": position.epoch,
                              "batch": position.batch, "tokens": position.tokens,
                              "seconds": position.seconds + elapsed},
                 "optimizer": optimizer.state_dict(), "rng": all_rng, "world_size": world}
        checkpoint.save(path, model, train_config, tokenizer.path, state)
        checkpoint.keep_last(out, train_config.keep_last)
    _barrier(world)
    return path


def _restore(out: Path, model: Seq2SeqModel, optimizer: torch.optim.Optimizer, rank: int,
             device: torch.device) -> Position:
    """Weights, optimizer, data position and RNG of the run's latest checkpoint."""
    latest = checkpoint.resolve(out)
    state_file = latest / checkpoint.TRAINER_STATE
    if not state_file.is_file():
        raise TrainingError(f"{latest}: no trainer state to resume from")
    restored = checkpoint.load_model_from(latest, device)
    model.load_state_dict(restored.state_dict())
    state = torch.load(state_file, map_location=device, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    rng = state["rng"][rank] if rank < len(state["rng"]) else state["rng"][0]
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    saved = state["position"]
    return Position(step=saved["step"], epoch=saved["epoch"], batch=saved["batch"],
                    tokens=saved["tokens"], seconds=saved["seconds"])


class _Log:
    """One JSON object per line, appended (a resumed run continues the same file)."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"time": time.time(), **record}) + "\n")


def _init_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return world, int(os.environ.get("RANK", "0"))


def _shutdown_distributed(world: int) -> None:
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _sum_over_processes(values: list[float], world: int, device: torch.device) -> list[float]:
    if world == 1:
        return values
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def _any_true(flag: bool, world: int, device: torch.device) -> bool:
    """Whether any process says so: all stop together."""
    return _sum_over_processes([float(flag)], world, device)[0] > 0
