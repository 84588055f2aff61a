"""What one token's mask costs under each kind of JSON Schema field, from a grammar never
used before (cold: the first request with a new schema) and once its masks are kept
(warm), ours (decode/constrained.py) against xgrammar's matcher, on the same tokens.

The vocabulary is bench/constrained.py's: a byte-level BPE of --vocab tokens trained on
the Python standard library's sources. Each field is the one property of an object
({"s": FIELD}, required). The tokens: after `{"s": `, a walk through our grammar that
takes, each step, a random allowed token of letters (else one without a backslash:
xgrammar writes no escapes where ours may), up to --steps tokens, the same for every peer. Each peer then computes the mask before
every token of it and takes the token: ours from a new TokenGrammar (cold) and again
(warm); xgrammar's GrammarMatcher over its compiled grammar (compiled once, outside the
timing; its compile time is recorded apart). "Another value": the grammar's second
request, a walk of another seed after the first, which meets the states the first did
not (a number, a string's length). Microseconds per token, median of
--repeats interleaved rounds. A sequence xgrammar refuses (it writes no escape in a
string with a maxLength) leaves it out of that field.

Then a server's view: one grammar of an object of three strings of a maxLength and an
integer through --requests walks of as many seeds (measure_requests).

    python bench/grammar_masks.py [--vocab 32000] [--steps 40] [--repeats 5]
        [--requests 40] [--out bench/results/grammar-masks-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from constrained import END, train_vocabulary, xgrammar_reads  # noqa: E402
from measure import machine_info, package_version, time_interleaved  # noqa: E402
from transduce.data.hf_tokenizer import HFTokenizer  # noqa: E402
from transduce.decode.constrained import TokenGrammar, Vocabulary  # noqa: E402
from transduce.decode.json_schema import compile_schema  # noqa: E402
from transduce.decode.token_bytes import token_bytes  # noqa: E402

FIELDS = {
    "string": {"type": "string"},
    "string, maxLength 60": {"type": "string", "maxLength": 60},
    "pattern": {"type": "string", "pattern": "^[a-z ]+$"},
    "pattern, maxLength 60": {"type": "string", "pattern": "^[a-z ]+$", "maxLength": 60},
    "email": {"type": "string", "format": "email"},
    "date-time": {"type": "string", "format": "date-time"},
    "integer 1..99999": {"type": "integer", "minimum": 1, "maximum": 99999},
    "enum": {"enum": ["pending", "shipped", "delivered"]},
}


def schema_of(field: dict) -> dict:
    return {"type": "object", "properties": {"s": field}, "required": ["s"]}


def walk(schema: dict, vocabulary: Vocabulary, prefix: list[int], steps: int,
         rng: random.Random) -> list[int]:
    """Tokens through our grammar from `prefix`: letters where allowed."""
    row = TokenGrammar(compile_schema(schema), vocabulary).start()
    for token in prefix:
        row.add(token)
    sequence = list(prefix)
    for _ in range(steps):
        allowed = row.allowed().nonzero().flatten().tolist()
        allowed = [t for t in allowed if t not in vocabulary.end_ids] or allowed
        letters = [t for t in allowed if (vocabulary.pieces[t] or b"").strip().isalpha()]
        unescaped = [t for t in allowed if b"\\" not in (vocabulary.pieces[t] or b"\\")]
        token = rng.choice(letters or unescaped or allowed)
        if token in vocabulary.end_ids:
            break
        row.add(token)
        sequence.append(token)
        if row.ended:
            break
    return sequence


def ours_pass(grammar: TokenGrammar, sequence: list[int]) -> float:
    start = time.perf_counter()
    row = grammar.start()
    for token in sequence:
        row.allowed()
        row.add(token)
    return time.perf_counter() - start


def xgrammar_pass(compiled, sequence: list[int], vocab: int) -> float:
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    start = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiled)
    for token in sequence:
        matcher.fill_next_token_bitmask(bitmask)
        if not matcher.accept_token(token):
            raise RuntimeError("xgrammar refused a token")
    return time.perf_counter() - start


def measure_field(name: str, field: dict, vocabulary: Vocabulary, prefix: list[int],
                  compiler, args) -> dict:
    schema = schema_of(field)
    sequence = walk(schema, vocabulary, prefix, args.steps, random.Random(name))
    record: dict = {"field": field, "tokens": len(sequence)}
    compiled = None
    if compiler is not None:
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        record["xgrammar compile ms"] = 1e3 * (time.perf_counter() - started)
        if not xgrammar_reads(compiled, sequence):
            record["xgrammar"] = "refuses the sequence"
            compiled = None
    warm = TokenGrammar(compile_schema(schema), vocabulary)
    ours_pass(warm, sequence)

    other = walk(schema, vocabulary, prefix, args.steps, random.Random(name + ", again"))

    def cold() -> float:
        return ours_pass(TokenGrammar(compile_schema(schema), vocabulary), sequence)

    def another_value() -> float:
        grammar = TokenGrammar(compile_schema(schema), vocabulary)
        ours_pass(grammar, sequence)
        return ours_pass(grammar, other)

    calls = {"ours cold": cold, "ours warm": lambda: ours_pass(warm, sequence),
             "ours another value": another_value}
    if compiled is not None:
        calls["xgrammar"] = lambda: xgrammar_pass(compiled, sequence, vocabulary.size)
    times = time_interleaved(calls, args.repeats)
    record["another value's tokens"] = len(other)
    for peer, seconds in times.items():
        tokens = len(other) if peer == "ours another value" else len(sequence)
        record[f"{peer} us/token"] = 1e6 * statistics.median(seconds) / tokens
    print(f"{name}: {len(sequence)} tokens, " + ", ".join(
        f"{peer} {record[f'{peer} us/token']:.0f} us" for peer in times))
    return record


# A server's requests with one schema: three strings of a maxLength and a bounded integer.
REQUESTS_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 100}, "city": {"type": "string", "maxLength": 100},
    "note": {"type": "string", "maxLength": 100},
    "id": {"type": "integer", "minimum": 1, "maximum": 99999}},
    "required": ["name", "city", "note", "id"]}


def measure_requests(vocabulary: Vocabulary, compiler, args) -> dict:
    """One grammar through --requests walks of as many seeds, one after another, as a
    server meets them: microseconds per token over the later half, where ours has
    settled (each state's mask found when first met, 128 kept), against xgrammar's
    matcher on the same walks; the median of --repeats rounds, each from a new grammar."""
    walks = [walk(REQUESTS_SCHEMA, vocabulary, [], 120, random.Random(seed))
             for seed in range(args.requests)]
    compiled = None if compiler is None else \
        compiler.compile_json_schema(json.dumps(REQUESTS_SCHEMA))
    later = [index for index in range(len(walks) // 2, len(walks))     # what both read
             if compiled is None or xgrammar_reads(compiled, walks[index])]
    tokens = sum(len(walks[index]) for index in later)
    ours, first, theirs = [], [], []
    for _ in range(args.repeats):
        grammar = TokenGrammar(compile_schema(REQUESTS_SCHEMA), vocabulary)
        seconds = [ours_pass(grammar, sequence) for sequence in walks]
        first.append(seconds[0] / len(walks[0]))
        ours.append(sum(seconds[index] for index in later) / tokens)
        if compiled is not None:
            theirs.append(sum(xgrammar_pass(compiled, walks[index], vocabulary.size)
                              for index in later) / tokens)
    record = {"schema": REQUESTS_SCHEMA, "requests": len(walks), "later requests": len(later),
              "later tokens": tokens,
              "ours first request us/token": 1e6 * statistics.median(first),
              "ours settled us/token": 1e6 * statistics.median(ours)}
    if theirs:
        record["xgrammar us/token"] = 1e6 * statistics.median(theirs)
    print("requests: " + ", ".join(f"{key} {value:.0f}" for key, value in record.items()
                                   if key.endswith("us/token")))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("bench/results/grammar-masks-cpu.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "tokenizer.json"
        train_vocabulary(args.vocab, path)
        tokenizer = HFTokenizer.from_file(path, bos=END, eos=END)
        vocabulary = Vocabulary(token_bytes(tokenizer, tokenizer.vocab_size),
                                [tokenizer.eos_id])
        compiler = None
        try:
            import transformers
            import xgrammar

            fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path),
                                                        eos_token=END)
            compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(
                fast, vocab_size=vocabulary.size))
        except ImportError:
            print("xgrammar is not installed: its peer is left out")
        prefix = tokenizer.encode(['{"s": '])[0]
        records = {name: measure_field(name, field, vocabulary, prefix, compiler, args)
                   for name, field in FIELDS.items()}
        requests = measure_requests(vocabulary, compiler, args)
    result = {"machine": machine_info(1),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "vocab": vocabulary.size, "fields": records, "requests": requests,
              "xgrammar": package_version("xgrammar")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
