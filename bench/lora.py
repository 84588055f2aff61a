"""Fine-tuning a language model with LoRA against fine-tuning it whole: our training step
both ways, and PEFT's LoRA and a full fine-tuning on transformers' LlamaForCausalLM, on
the same weights and the same batch.

A random LlamaForCausalLM of the asked shape (--layers etc.; grouped-query attention,
SwiGLU) is saved with save_pretrained and imported with `transduce import hf-llama`.
Every peer steps on one batch of --rows rows of --length random token ids: the forward
pass over all of them, the mean cross entropy of the --length - 1 next tokens of each
row, backward, fused Adam over what trains; in float32 and under bfloat16 autocast.
Ours is the step `transduce train` takes (train/objective.py's loss), with adapters of
rank --rank on every attention and feed-forward matrix (model/lora.py) or none, and with
the adapted layers' frozen weights kept in int8 or NF4, its scales in 8 bits or not
(--lora-base-dtype int8, nf4, nf4-dq; model/quantized_weight.py), and in bfloat16 also
kept in bfloat16; theirs is the model called with labels, wrapped by
peft.get_peft_model with the same rank, alpha and modules, or not, and QLoRA's way:
loaded by transformers with bitsandbytes' NF4 (BitsAndBytesConfig(load_in_4bit=True),
the compute dtype the step's; bnb_4bit_use_double_quant for nf4-dq's peer). The peers
alternate rounds of --steps steps, --repeats times; counted: target tokens per second
of the median round. Beside the speed, what each keeps for training, counted from the
tensors: the weights' bytes (parameters and buffers, bitsandbytes' block scales too),
parameters trained, and the bytes of their gradients and Adam's two moments (float32).

    python bench/lora.py [--layers 12 --d-model 768] [--rank 8] [--steps 2] [--dtypes float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, time_interleaved  # noqa: E402
from transduce.importers import import_llama  # noqa: E402
from transduce.model import load_model  # noqa: E402
from transduce.model.lora import LoRASettings, adapter_layers, add_adapters  # noqa: E402
from transduce.train.objective import SequenceObjective  # noqa: E402

HF_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_hf_model(args: argparse.Namespace, directory: Path) -> None:
    """A random LlamaForCausalLM with a byte-level vocabulary, where our importer reads it."""
    import tokenizers
    import transformers

    bpe = tokenizers.SentencePieceBPETokenizer()
    bpe.train_from_iterator(["a b c"], vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                            show_progress=False)
    directory.mkdir(parents=True)
    bpe.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_ff,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.length,
        bos_token_id=1, eos_token_id=2)).save_pretrained(directory)


def step_round(forward, parameters, steps: int, dtype: torch.dtype):
    """A round of `steps` training steps: forward() -> the mean loss, backward, Adam."""
    optimizer = torch.optim.Adam(parameters, lr=1e-5, fused=True)

    def run() -> None:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = forward()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return run, optimizer


def ours(imported: Path, ids: torch.Tensor, rank: int | None, kept: str | None = None):
    model = load_model(imported).train()
    if rank:
        add_adapters(model, LoRASettings(rank=rank, alpha=2.0 * rank))
    for layer in adapter_layers(model).values() if kept else ():
        layer.keep_frozen_in(kept)        # --lora-base-dtype bfloat16 | int8 | nf4 | nf4-dq
    objective = SequenceObjective(model, language_model=True, label_smoothing=0.0)
    targets = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # 0: pad, unscored
    scored = int((targets != 0).sum())
    return model, lambda: objective(None, ids, targets) / scored


QUANTIZED = ["int8", "nf4", "nf4-dq"]     # --lora-base-dtype's formats


def theirs(hf_dir: Path, ids: torch.Tensor, rank: int | None, nf4_in: torch.dtype | None = None,
           double: bool = False):
    """nf4_in: the frozen weights in bitsandbytes' NF4, multiplied in that dtype (QLoRA);
    double: their block scales in 8 bits too."""
    import peft
    import transformers

    quantized = {} if nf4_in is None else {"device_map": "cpu", "quantization_config":
                                           transformers.BitsAndBytesConfig(
                                               load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=nf4_in,
                                               bnb_4bit_use_double_quant=double)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # bitsandbytes' notes on the CUDA it does not find
        model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, **quantized).train()
    if rank:
        # peft calls a transformers method that transformers 5 deprecates.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=HF_MODULES, lora_dropout=0.0,
            task_type="CAUSAL_LM"))
    return model, lambda: model(input_ids=ids, labels=ids).loss


def training_state(model) -> dict:
    """What training keeps: the weights (parameters, buffers, and the block scales
    bitsandbytes keeps beside its 4-bit ones), and beside them the trained parameters,
    their gradients and Adam's moments, in bytes (float32)."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    states = [p.quant_state for p in model.parameters()
              if getattr(p, "quant_state", None) is not None]
    scales = [state.absmax for state in states] + [
        tensor for state in states if state.nested
        for tensor in (state.state2.absmax, state.offset)]
    tensors = [*model.parameters(), *model.buffers(), *scales]
    return {"weight_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "trained_parameters": trained, "gradient_bytes": 4 * trained,
            "adam_bytes": 8 * trained}


def peer_cases(args: argparse.Namespace, imported: Path, hf_dir: Path, ids: torch.Tensor
               ) -> tuple[dict, dict]:
    """Each peer's round of steps by name ("ours LoRA r=8 bfloat16"), and what each keeps
    for training by peer ("ours LoRA r=8")."""
    builds = [("ours", lambda rank: ours(imported, ids, rank)),
              ("transformers", lambda rank: theirs(hf_dir, ids, rank))]
    calls, states = {}, {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        cases = [(peer, f"LoRA r={rank}" if rank else "full", lambda b=build, r=rank: b(r))
                 for peer, build in builds for rank in (None, args.rank)]
        kept = QUANTIZED + (["bfloat16"] if dtype == torch.bfloat16 else [])
        cases += [("ours", f"LoRA r={args.rank}, frozen {kind}",
                   lambda k=kind: ours(imported, ids, args.rank, k)) for kind in kept]
        cases += [("transformers", f"LoRA r={args.rank}, frozen {kind}",
                   lambda d=dtype, k=kind: theirs(hf_dir, ids, args.rank, nf4_in=d,
                                                  double=k == "nf4-dq"))
                  for kind in ("nf4", "nf4-dq")]
        for peer, kind, build in cases:
            model, forward = build()
            trained = [p for p in model.parameters() if p.requires_grad]
            calls[f"{peer} {kind} {dtype_name}"], _ = step_round(forward, trained, args.steps,
                                                                 dtype)
            states[f"{peer} {kind}"] = training_state(model)
    return calls, states


def ratios_of(args: argparse.Namespace, peers: dict) -> dict[str, float]:
    def speed(name: str) -> float:
        return peers[name]["tokens_per_s"]

    ratios = {}
    for d in args.dtypes:
        lora, full = f"LoRA r={args.rank}", "full"
        ratios[f"ours LoRA / ours full, {d}"] = \
            speed(f"ours {lora} {d}") / speed(f"ours {full} {d}")
        ratios[f"ours LoRA / PEFT LoRA, {d}"] = \
            speed(f"ours {lora} {d}") / speed(f"transformers {lora} {d}")
        ratios[f"ours full / transformers full, {d}"] = \
            speed(f"ours {full} {d}") / speed(f"transformers {full} {d}")
        for kind in QUANTIZED + (["bfloat16"] if d == "bfloat16" else []):
            ratios[f"ours LoRA, frozen {kind} / ours LoRA, {d}"] = \
                speed(f"ours {lora}, frozen {kind} {d}") / speed(f"ours {lora} {d}")
        for kind in ("nf4", "nf4-dq"):
            ratios[f"ours LoRA, frozen {kind} / PEFT LoRA on bitsandbytes {kind}, {d}"] = \
                speed(f"ours {lora}, frozen {kind} {d}") / \
                speed(f"transformers {lora}, frozen {kind} {d}")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("bench/results/lora-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        build_hf_model(args, scratch / "hf")
        imported = import_llama(scratch / "hf", scratch / "ours")
        torch.manual_seed(1)
        ids = torch.randint(3, args.vocab, (args.rows, args.length))
        calls, states = peer_cases(args, imported, scratch / "hf", ids)
        started = time.time()
        times = time_interleaved(calls, args.repeats)
    tokens = args.steps * args.rows * (args.length - 1)
    peers = {name: {"seconds": statistics.median(seconds), "all_seconds": seconds,
                    "tokens_per_s": tokens / statistics.median(seconds)}
             for name, seconds in times.items()}
    ratios = ratios_of(args, peers)
    for name, peer in peers.items():
        print(f"{name}: {peer['tokens_per_s']:.0f} tokens/s")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x")
    for name, state in states.items():
        print(f"{name}: {state['trained_parameters']:,d} parameters trained; weights "
              f"{state['weight_bytes'] / 2**20:.0f} MiB, gradients "
              f"+ Adam {(state['gradient_bytes'] + state['adam_bytes']) / 2**20:.1f} MiB")
    result = {"machine": machine_info(args.threads),
              "settings": vars(args) | {"out": str(args.out)},
              "target_tokens_per_round": tokens, "peers": peers, "ratios": ratios,
              "training_state": states, "seconds": time.time() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
