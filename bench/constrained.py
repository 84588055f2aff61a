"""Generation under a JSON Schema: what keeping every token to the grammar costs, ours
(GenerateOptions.json_schema, decode/constrained.py) against transformers' `generate`
with xgrammar's logits processor, on the same weights.

A GPT-2 (124M, `--layers` etc. to change it) of random weights is built by transformers
over a byte-level BPE of --vocab tokens trained here on the Python standard library's
sources (code: quotes, braces, digits and escapes, as JSON has them), saved, and
imported with `transduce import hf-gpt2`. Four peers, interleaved over --repeats rounds,
greedy from prompts of --prompt-length random tokens, batch 1 and batch 8:
ours and transformers' generate free, and each under the schema (ours: its grammar;
transformers: xgrammar's compiled JSON Schema, any whitespace, its LogitsProcessor).
Counted: the tokens each generated per second of the whole call; a constrained peer's
tokens differ from the free one's (and the two grammars allow different whitespace), so
each counts its own. Then the engines alone, on the token sequences ours generated:
microseconds per token to compute the allowed tokens and take the chosen one (the texts
encoded again without a leading space, which xgrammar's JSON does not open with), ours cold
(a new grammar: no cached masks) and warm (the same sequences again), and xgrammar's
GrammarMatcher (fill_next_token_bitmask, accept_token).

    python bench/constrained.py [--repeats 3] [--new-tokens 64] [--vocab 32000]
        [--schema orders|checked] [--out bench/results/constrained-cpu.json]

xgrammar is this benchmark's alone (`pip install -e '.[bench]'`); without it the
xgrammar peers are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, package_version, time_interleaved  # noqa: E402
from transduce.decode.generate import Generator  # noqa: E402
from transduce.decode.options import GenerateOptions  # noqa: E402
from transduce.importers import import_gpt2  # noqa: E402

END = "<|endoftext|>"
SCHEMA = {
    "type": "object", "required": ["id", "customer", "status", "items", "paid"],
    "properties": {
        "id": {"type": "integer"}, "customer": {"type": "string"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {"type": "array", "items": {
            "type": "object", "required": ["sku", "quantity"],
            "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer"}}}},
        "paid": {"type": "boolean"}}}
# The same order with the assertions generation keeps as it writes: a pattern, formats,
# lengths and bounds (xgrammar keeps these too).
CHECKED = {
    "type": "object", "required": ["id", "customer", "email", "placed", "items", "paid"],
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "customer": {"type": "string", "minLength": 1, "maxLength": 40},
        "email": {"type": "string", "format": "email"},
        "placed": {"type": "string", "format": "date-time"},
        "items": {"type": "array", "maxItems": 5, "items": {
            "type": "object", "required": ["sku", "quantity", "price"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                           "price": {"type": "number", "exclusiveMinimum": 0,
                                     "maximum": 10000}}}},
        "paid": {"type": "boolean"}}}
SCHEMAS = {"orders": SCHEMA, "checked": CHECKED}


def train_vocabulary(size: int, path: Path) -> None:
    """A byte-level BPE of `size` tokens on the standard library's .py files, END last."""
    from tokenizers import ByteLevelBPETokenizer

    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = (source.read_text(encoding="utf-8", errors="replace") for source in sources)
    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(texts, vocab_size=size - 1, min_frequency=2,
                                show_progress=False)
    trained.add_special_tokens([END])
    trained.save(str(path))


def build(args: argparse.Namespace, directory: Path):
    """transformers' GPT-2 over the trained vocabulary, saved and imported -> (it, ours,
    its tokenizer for xgrammar)."""
    import transformers

    hf_dir = directory / "hf"
    hf_dir.mkdir()
    train_vocabulary(args.vocab, hf_dir / "tokenizer.json")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(hf_dir / "tokenizer.json"), bos_token=END, eos_token=END,
        pad_token=END)
    vocab = len(tokenizer)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.d_model, n_head=args.heads, n_positions=1024,
        vocab_size=vocab, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id)).eval()
    hf.save_pretrained(hf_dir)
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": END, "eos_token": END, "pad_token": END}))
    import_gpt2(hf_dir, directory / "ours")
    return hf, Generator.load(directory / "ours"), tokenizer


def compare_generation(hf, ours: Generator, xgrammar_grammar, args) -> tuple[list, dict]:
    """Each batch size: the four peers on the same prompts, interleaved -> records, and
    ours' constrained token sequences by batch."""
    free = GenerateOptions(max_new_tokens=args.new_tokens, batch_sentences=8)
    constrained = free.replace(json_schema=SCHEMAS[args.schema])
    eos = ours.tokenizer.eos_id
    records, sequences = [], {}
    for batch in (1, 8):
        ids = torch.randint(0, hf.config.vocab_size - 1, (batch, args.prompt_length),
                            generator=torch.Generator().manual_seed(batch))
        outputs: dict[str, list[list[int]]] = {}

        def ours_run(name, options):
            def run():
                outputs[name] = [r.tokens for r in ours._generate_batch(ids.tolist(), options)]
            return run

        def hf_run(name, grammar):
            def run():
                processors = []
                if grammar is not None:
                    import xgrammar

                    processors = [xgrammar.contrib.hf.LogitsProcessor(grammar)]
                with torch.inference_mode():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=args.new_tokens, pad_token_id=eos,
                                      logits_processor=processors)
                outputs[name] = [[t for t in row if t != eos]
                                 for row in out[:, ids.shape[1]:].tolist()]
            return run

        calls = {"ours": ours_run("ours", free), "ours json": ours_run("ours json", constrained),
                 "hf generate": hf_run("hf generate", None)}
        if xgrammar_grammar is not None:
            calls["hf generate + xgrammar"] = hf_run("hf generate + xgrammar", xgrammar_grammar)
        times = time_interleaved(calls, args.repeats)
        record = {"batch": batch}
        for name, seconds in times.items():
            tokens = sum(map(len, outputs[name]))
            record[name] = {"seconds": statistics.median(seconds), "generated_tokens": tokens,
                            "tokens_per_s": tokens / statistics.median(seconds)}
        record["ours json / ours"] = (record["ours json"]["tokens_per_s"]
                                      / record["ours"]["tokens_per_s"])
        if xgrammar_grammar is not None:
            record["hf + xgrammar / hf"] = (record["hf generate + xgrammar"]["tokens_per_s"]
                                            / record["hf generate"]["tokens_per_s"])
            record["ours json / hf + xgrammar"] = (
                record["ours json"]["tokens_per_s"]
                / record["hf generate + xgrammar"]["tokens_per_s"])
        print(f"batch {batch}: " + ", ".join(f"{name} {record[name]['tokens_per_s']:.1f} tok/s"
                                             for name in calls)
              + "; " + ", ".join(f"{k} {v:.2f}x" for k, v in record.items() if "/" in k))
        records.append(record)
        sequences[batch] = outputs["ours json"]
    return records, sequences


def compare_engines(ours: Generator, xgrammar_grammar, sequences: list[list[int]],
                    args: argparse.Namespace) -> dict:
    """Microseconds per token of the constraint alone over `sequences`: ours cold and
    warm, xgrammar's matcher."""
    from transduce.decode.constrained import TokenGrammar
    from transduce.decode.reply_grammar import compile_grammar

    # xgrammar's JSON opens without a space, ours may with one: both read the texts
    # without it, encoded again.
    texts = [ours.tokenizer.decode(each).removeprefix(" ") for each in sequences]
    sequences = ours.tokenizer.encode(texts)

    refused = [] if xgrammar_grammar is None else [
        each for each in sequences if not xgrammar_reads(xgrammar_grammar, each)]
    sequences = [each for each in sequences if each not in refused]
    spec = json.loads(GenerateOptions(json_schema=SCHEMAS[args.schema]).reply_grammar)
    vocabulary = ours.grammar(json.dumps(spec)).vocabulary
    tokens = sum(map(len, sequences))
    found: dict[str, list[float]] = {}

    def ours_pass(grammar: TokenGrammar) -> float:
        start = time.perf_counter()
        for sequence in sequences:
            row = grammar.start()
            for token in sequence:
                row.allowed()
                row.add(token)
        return time.perf_counter() - start

    def xgrammar_pass() -> float:
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(1, ours.model.config.tgt_vocab_size)
        start = time.perf_counter()
        for sequence in sequences:
            matcher = xgrammar.GrammarMatcher(xgrammar_grammar)
            for token in sequence:
                matcher.fill_next_token_bitmask(bitmask)
                if not matcher.accept_token(token):
                    raise RuntimeError("xgrammar refused a token of our JSON")
        return time.perf_counter() - start

    for _ in range(args.repeats):
        grammar = TokenGrammar(compile_grammar(spec), vocabulary)
        found.setdefault("ours cold", []).append(ours_pass(grammar))
        found.setdefault("ours warm", []).append(ours_pass(grammar))
        if xgrammar_grammar is not None:
            found.setdefault("xgrammar", []).append(xgrammar_pass())
    result = {name: {"us_per_token": 1e6 * statistics.median(seconds) / tokens}
              for name, seconds in found.items()}
    result["tokens"], result["sequences"] = tokens, len(sequences)
    result["left out, xgrammar refusing them"] = [ours.tokenizer.decode(each)
                                                   for each in refused]
    print(f"per token, {len(sequences)} sequences of {tokens} tokens: " + ", ".join(
        f"{name} {value['us_per_token']:.0f} us" for name, value in result.items()
        if isinstance(value, dict)))
    return result


def xgrammar_reads(grammar, sequence: list[int]) -> bool:
    """Whether xgrammar's matcher takes every token of `sequence` (it writes no escape
    in a string with a maxLength, where ours may: the two compare on what both take)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(grammar)
    return all(matcher.accept_token(token) for token in sequence)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schema", choices=sorted(SCHEMAS), default="orders",
                        help="orders: types, enums, arrays; checked: the same order with "
                             "a pattern, formats, lengths and bounds")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("bench/results/constrained-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        hf, ours, tokenizer = build(args, Path(scratch))
        xgrammar_grammar = None
        try:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=ours.model.config.tgt_vocab_size)
            xgrammar_grammar = xgrammar.GrammarCompiler(info).compile_json_schema(
                json.dumps(SCHEMAS[args.schema]))
        except ImportError:
            print("xgrammar is not installed: its peers are left out")
        started = time.time()
        records, sequences = compare_generation(hf, ours, xgrammar_grammar, args)
        engines = compare_engines(ours, xgrammar_grammar, sequences[8], args)
    result = {"machine": machine_info(args.threads),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "model": {"family": "gpt2", "parameters": ours.model.num_parameters(),
                        "vocab": ours.model.config.tgt_vocab_size},
              "schema": SCHEMAS[args.schema], "peers": records, "engines": engines,
              "xgrammar": package_version("xgrammar"),
              "seconds": time.time() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
