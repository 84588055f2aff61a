"""Language-model generation speed: our decoder-only model against Hugging Face's
`generate` (GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM,
Gemma2ForCausalLM, GPTNeoXForCausalLM, PhiForCausalLM or CodeGenForCausalLM), on the
same weights.

A GPT-2 (124M), with `--family llama` a Llama of SmolLM2-135M's shape (30 layers of
576, 9 heads sharing 3 key/value heads, SwiGLU 1536, tied embeddings), or with
`--family qwen3` a Qwen3 of Qwen3-0.6B's shape (28 layers of 1024, 16 heads of 128
sharing 8 key/value heads, queries and keys RMS-normalized per head, SwiGLU 3072, tied
embeddings over 151,936 tokens), or with `--family gemma3` a Gemma 3 of gemma-3-270m's
shape (18 layers of 640, 4 heads of 256 sharing one key/value head, a window of 512
keys on five layers in six, GeGLU 2048, tied embeddings over 262,144 tokens), or with
`--family gemma2` a Gemma 2 of the same shape (its 256,000 tokens, a window of 4,096 on
one layer in two, scores soft-capped at 50 and logits at 30: CTranslate2 has no cap,
so give --no-ctranslate2), or with `--family pythia` a GPT-NeoX of Pythia-160m's shape
(12 layers of 768, 12 heads, parallel residuals, rotary positions on a quarter of each
head, an untied output over 50,304 tokens), or with `--family phi` a Phi of phi-1_5's
shape (24 layers of 2048, 32 heads, parallel residuals over one norm, rotary positions on
half of each head, an untied output with a bias over 51,200 tokens), or with `--family
codegen` a CodeGen of codegen-350M's shape (20 layers of 1024, 16 heads, GPT-J's layer:
parallel over one norm, bias-free attention, 32 of each head's 64 features turned in
adjacent pairs, an untied output with a bias over 51,200 tokens); `--layers` etc.
change any. It is built by transformers from a random config, saved with
save_pretrained, and imported with `transduce import hf-gpt2` / `hf-llama` / `hf-gemma` /
`hf-gpt-neox` / `hf-phi` / `hf-gptj`, so every peer holds the same weights:
- CTranslate2's Generator runs our `export ct2` of the import (float32, the same
  threads; `--no-ctranslate2` leaves it out) in a child process per call, which times
  itself after a warm-up: loaded into this process, its thread runtime slowed the
  PyTorch peers 1.3-1.5x for as long as the process lived;
- ONNX Runtime runs our `export onnx` of it behind our Generator (float32, and with
  `--quantize int8`'s int8 weights, the same threads; `--no-onnx` leaves both out).
Our Generator also runs in bfloat16 and int8 (`--our-dtypes`), the types `--dtype auto`
picks on CPUs with AMX and with VNNI, and with `--modules` in float32 through its modules
alone (no written-out decoder step, model/decoder_step.py), to measure what the step
gives. Greedy generation of --new-tokens tokens from
prompts of --prompt-length random tokens, batch 1 and batch 8 (same-length prompts: no
padding on any side), interleaved over --repeats rounds. Counted: generated tokens, per
second of the whole call (prompt prefill included); the float32 peers' tokens are checked
equal to ours, token for token, and a quantized or bfloat16 peer counts its own. Decode
speed by KV-cache kind (float32, int8, int4, sliding) is bench/kv_cache.py's.

    python bench/generate.py [--family gpt2|llama|qwen3|gemma3|gemma2|pythia|phi|codegen]
        [--repeats 3]
        [--no-ctranslate2] [--no-onnx] [--our-dtypes bfloat16 int8] [--modules]
        [--out bench/results/generate-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, time_interleaved  # noqa: E402
from transduce.decode.generate import Generator  # noqa: E402
from transduce.decode.options import GenerateOptions  # noqa: E402
from transduce import checkpoint  # noqa: E402
from transduce.export import export_ctranslate2  # noqa: E402
from transduce.decode.onnx_lm_engine import OnnxLanguageModel  # noqa: E402
from transduce.export.onnx import export_onnx  # noqa: E402
from transduce.importers import import_gemma, import_gpt2, import_gpt_neox, \
    import_gptj, import_llama, import_phi  # noqa: E402

# Each family's shape (overridden by the flags of the same names) and importer.
FAMILIES = {
    "gpt2": {"layers": 12, "d_model": 768, "heads": 12, "kv_heads": 12, "d_ff": 3072,
             "vocab": 50257, "context": 1024, "importer": import_gpt2},
    "llama": {"layers": 30, "d_model": 576, "heads": 9, "kv_heads": 3, "d_ff": 1536,
              "vocab": 49152, "context": 2048, "importer": import_llama},
    "qwen3": {"layers": 28, "d_model": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128,
              "d_ff": 3072, "vocab": 151936, "context": 4096, "importer": import_llama},
    "gemma3": {"layers": 18, "d_model": 640, "heads": 4, "kv_heads": 1, "head_dim": 256,
               "d_ff": 2048, "vocab": 262144, "context": 4096, "importer": import_gemma},
    "gemma2": {"layers": 18, "d_model": 640, "heads": 4, "kv_heads": 1, "head_dim": 256,
               "d_ff": 2048, "vocab": 256000, "context": 8192, "importer": import_gemma},
    "pythia": {"layers": 12, "d_model": 768, "heads": 12, "kv_heads": 12, "d_ff": 3072,
               "vocab": 50304, "context": 2048, "importer": import_gpt_neox},
    "phi": {"layers": 24, "d_model": 2048, "heads": 32, "kv_heads": 32, "d_ff": 8192,
            "vocab": 51200, "context": 2048, "importer": import_phi},
    "codegen": {"layers": 20, "d_model": 1024, "heads": 16, "kv_heads": 16, "d_ff": 4096,
                "vocab": 51200, "context": 2048, "importer": import_gptj},
}
GEMMA3_WINDOW = 512        # gemma-3-270m's sliding window; every sixth layer full
END = "<|endoftext|>"


def hf_model(args: argparse.Namespace):
    """A random model of the family from transformers, seeded."""
    import transformers

    torch.manual_seed(0)
    if args.family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=args.layers, n_embd=args.d_model, n_head=args.heads, n_inner=args.d_ff,
            n_positions=args.context, vocab_size=args.vocab, bos_token_id=args.vocab - 1,
            eos_token_id=args.vocab - 1)).eval()
    if args.family == "gemma3":
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            num_hidden_layers=args.layers, hidden_size=args.d_model,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            head_dim=args.head_dim, query_pre_attn_scalar=args.head_dim,
            intermediate_size=args.d_ff, max_position_embeddings=args.context,
            vocab_size=args.vocab, sliding_window=GEMMA3_WINDOW, bos_token_id=args.vocab - 1,
            eos_token_id=args.vocab - 1, pad_token_id=args.vocab - 1)).eval()
    if args.family == "pythia":     # GPTNeoXConfig's parallel residuals, rotary_pct 0.25
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            num_hidden_layers=args.layers, hidden_size=args.d_model,
            num_attention_heads=args.heads, intermediate_size=args.d_ff,
            max_position_embeddings=args.context, vocab_size=args.vocab,
            bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1)).eval()
    if args.family == "phi":        # PhiConfig's one norm a layer, half of each head turned
        return transformers.PhiForCausalLM(transformers.PhiConfig(
            num_hidden_layers=args.layers, hidden_size=args.d_model,
            num_attention_heads=args.heads, intermediate_size=args.d_ff,
            max_position_embeddings=args.context, vocab_size=args.vocab,
            partial_rotary_factor=0.5, bos_token_id=args.vocab - 1,
            eos_token_id=args.vocab - 1)).eval()
    if args.family == "codegen":    # CodeGen's fused q, v, k; rotary_dim 32 (of 64)
        return transformers.CodeGenForCausalLM(transformers.CodeGenConfig(
            n_layer=args.layers, n_embd=args.d_model, n_head=args.heads, n_inner=args.d_ff,
            n_positions=args.context, n_ctx=args.context, vocab_size=args.vocab,
            rotary_dim=32, bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1)).eval()
    if args.family == "gemma2":     # Gemma2Config's window (4,096) and caps (50, 30)
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            num_hidden_layers=args.layers, hidden_size=args.d_model,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            head_dim=args.head_dim, query_pre_attn_scalar=args.head_dim,
            intermediate_size=args.d_ff, max_position_embeddings=args.context,
            vocab_size=args.vocab, bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1,
            pad_token_id=args.vocab - 1)).eval()
    llama = args.family == "llama"
    config_class, model_class = (transformers.LlamaConfig, transformers.LlamaForCausalLM) \
        if llama else (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
    return model_class(config_class(
        num_hidden_layers=args.layers, hidden_size=args.d_model, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.d_ff,
        max_position_embeddings=args.context, vocab_size=args.vocab, tie_word_embeddings=True,
        bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1,
        **({} if llama else {"head_dim": args.head_dim}))).eval()


def build_hf_model(args: argparse.Namespace, directory: Path):
    """A random model from transformers, saved where our importer reads it, with a
    byte-level vocabulary of its size (the tokens are random ids anyway) whose last
    token is both bos and eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    model = hf_model(args)
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(args.vocab - 1)}
    vocab[END] = args.vocab - 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": END, "eos_token": END, "pad_token": END}))
    return model


def prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (batch, length), generator=generator)   # no eos


def ct2_in_child(export: Path, pieces: list[list[str]], args: argparse.Namespace
                 ) -> tuple[list[list[int]], float]:
    """CTranslate2's greedy generation of `pieces` in a child process -> its token ids
    and the seconds of the call it timed (after a warm-up call on the same prompts)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(pieces, f)
    result = subprocess.run(
        [sys.executable, __file__, "--ct2-worker", str(export), "--prompts", f.name,
         "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)],
        capture_output=True, text=True, check=True)
    Path(f.name).unlink()
    answer = json.loads(result.stdout.splitlines()[-1])
    return answer["ids"], answer["seconds"]


def ct2_worker(args: argparse.Namespace) -> None:
    """Child process: load the export, warm up, time one call; print JSON."""
    import ctranslate2

    generator = ctranslate2.Generator(str(args.ct2_worker), device="cpu",
                                      compute_type="float32", intra_threads=args.threads)
    pieces = json.loads(Path(args.prompts).read_text())

    def run():
        return generator.generate_batch(pieces, max_length=args.new_tokens, sampling_topk=1,
                                        include_prompt_in_result=False)

    run()
    start = time.perf_counter()
    found = run()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "ids": [r.sequences_ids[0] for r in found]}))


def compare_peers(hf, generators: dict[str, Generator], ct2: Path | None,
                  args: argparse.Namespace) -> list[dict]:
    """Each batch size: every peer on the same prompts, interleaved; tokens/s over the
    tokens each generated (the same as ours, checked, but for a quantized export's).
    generators: ours, then our Generator on other engines."""
    options = GenerateOptions(max_new_tokens=args.new_tokens, batch_sentences=8)
    ours = generators["ours"]
    eos = ours.tokenizer.eos_id
    rows = []
    for batch in (1, 8):
        ids = prompts(batch, args.prompt_length, hf.config.vocab_size, seed=batch)
        pieces = [[ours.tokenizer.piece(t) for t in row] for row in ids.tolist()]
        outputs: dict[str, list[list[int]]] = {}

        def run_hf():
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=args.new_tokens, pad_token_id=eos)
            outputs["hf generate"] = [[t for t in row if t != eos] for row in
                                      out[:, ids.shape[1]:].tolist()]

        def run_generator(name: str):
            def run():
                found = generators[name]._generate_batch(ids.tolist(), options)
                outputs[name] = [row.tokens for row in found]
            return run

        def run_ct2() -> float:
            outputs["ctranslate2"], seconds = ct2_in_child(ct2, pieces, args)
            return seconds

        calls = {"hf generate": run_hf, **{name: run_generator(name) for name in generators}}
        if ct2 is not None:
            calls["ctranslate2"] = run_ct2
        times = time_interleaved(calls, args.repeats)
        tokens = sum(len(row) for row in outputs["ours"])
        record = {"batch": batch, "prompt_length": args.prompt_length, "generated_tokens": tokens}
        for name, seconds in times.items():
            own = sum(len(row) for row in outputs[name])
            record[name] = {"seconds": statistics.median(seconds), "generated_tokens": own,
                            "tokens_per_s": own / statistics.median(seconds),
                            "equal_outputs": outputs[name] == outputs["ours"]}
        record["ratio"] = record["ours"]["tokens_per_s"] / record["hf generate"]["tokens_per_s"]
        print(f"batch {batch}: " + ", ".join(
            f"{name} {record[name]['tokens_per_s']:.1f} tok/s (same tokens: "
            f"{record[name]['equal_outputs']})" for name in calls) +
            f"; ours / HF {record['ratio']:.2f}x")
        rows.append(record)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="gpt2")
    for name in ("layers", "d_model", "heads", "kv_heads", "head_dim", "d_ff", "vocab",
                 "context"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help="default: the family's")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-ctranslate2", dest="ctranslate2", action="store_false",
                        help="leave CTranslate2's Generator (on our ct2 export) out")
    parser.add_argument("--no-onnx", dest="onnx", action="store_false",
                        help="leave ONNX Runtime (on our onnx export) out")
    parser.add_argument("--our-dtypes", nargs="*", default=["bfloat16", "int8"],
                        choices=["bfloat16", "int8"],
                        help="our Generator in these types too (as more peers)")
    parser.add_argument("--modules", action="store_true",
                        help="our float32 Generator without its written-out decoder step too")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("bench/results/generate-cpu.json"))
    parser.add_argument("--ct2-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ct2_worker:
        ct2_worker(args)
        return
    family = FAMILIES[args.family]
    for name, value in family.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        result = run_peers(args, family, Path(scratch))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def run_peers(args: argparse.Namespace, family: dict, scratch: Path) -> dict:
    """Build the model and every peer's copy of it under `scratch`, then compare them."""
    hf = build_hf_model(args, scratch / "hf")
    family["importer"](scratch / "hf", scratch / "ours")
    ours = Generator.load(scratch / "ours")
    ct2 = None
    if args.ctranslate2:      # float32, as the others, on as many threads (ct2_worker)
        ct2 = export_ctranslate2(scratch / "ours", scratch / "ct2")
    generators = {"ours": ours}
    for dtype in args.our_dtypes:   # the copies `--dtype auto` chooses among, by the CPU
        generators[f"ours {dtype}"] = Generator.load(scratch / "ours", dtype=dtype)
    if args.modules:
        generators["ours modules"] = modules = Generator.load(scratch / "ours")
        modules.model.decoder.fast_step = None
    if args.onnx:             # on as many threads, behind our Generator
        for name, quantize in (("onnxruntime", None), ("onnxruntime int8", "int8")):
            exported = export_onnx(scratch / "ours", scratch / name.replace(" ", "-"), quantize)
            generators[name] = Generator(OnnxLanguageModel(exported, threads=args.threads),
                                         checkpoint.load_tokenizer(exported))
    started = time.time()
    settings = {name: value for name, value in vars(args).items()
                if name not in ("importer", "ct2_worker", "prompts")}
    return {"machine": machine_info(args.threads), "settings": settings | {"out": str(args.out)},
            "model": {"family": args.family, "layers": args.layers, "d_model": args.d_model,
                      "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                      "parameters": ours.model.num_parameters()},
            "peers": compare_peers(hf, generators, ct2, args),
            "seconds": time.time() - started}


if __name__ == "__main__":
    main()
