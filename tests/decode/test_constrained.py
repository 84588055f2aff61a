"""Generation under a json_schema: the tokens' bytes are what the tokenizers decode, a
mask allows exactly the tokens whose bytes the grammar reads, and a Generator's greedy
continuation is a reference loop's (a full pass each step, every token checked alone);
batched equals alone, sampled rows too, and what comes out is an instance."""

import gc
import itertools
import json
import random
import weakref

import pytest
import torch

from transduce.config import ConfigError, preset
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.data.tokenizer import Tokenizer
from transduce.data.reasoning import reasoning_grammar
from transduce.decode.constrained import TokenGrammar, Vocabulary, constrained
from transduce.decode.generate import Generator, prompt_seeds
from transduce.decode.json_grammar import Root, advance, complete, ended, special_symbol, start
from transduce.decode.json_schema import SchemaError, compile_schema
from transduce.decode.options import GenerateOptions
from transduce.decode.reply_grammar import compile_grammar
from transduce.decode.string_formats import FORMATS
from transduce.decode.token_bytes import byte_level_table, token_bytes
from transduce.model import build_model

tokenizers = pytest.importorskip("tokenizers")
jsonschema = pytest.importorskip("jsonschema")

TEXTS = ['{"name": "Ann", "tags": ["a", "b"], "n": -12.5e3, "ok": true, "x": null}',
         'quote " backslash \\ tab \t newline \n é 中文 🙂', "\u0001 control", "[1, 2, 3]",
         "paths C:\\query\\x and C:\\query\\y"]       # tokens of a backslash and no escape
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "color"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                         "color": {"enum": ["red", "green"]},
                         "note": {"type": ["string", "null"]}}}
# No free strings, no whitespace: a random model's greedy JSON closes within 120 tokens.
FINITE = {"type": "object", "required": ["ok", "n", "color"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                         "color": {"enum": ["red", "green"]}}}
PROMPTS = ["uno dos", "el perro grande come", "casa", "tres gato rojo rojo el casa perro"]


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory):
    """A byte-level BPE (GPT-2's kind) trained on JSON-like text, a few hundred tokens."""
    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(TEXTS * 3 + [json.dumps(SCHEMA)] * 3, vocab_size=400,
                                min_frequency=1, special_tokens=["<|endoftext|>"],
                                show_progress=False)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    trained.save(str(path))
    return HFTokenizer.from_file(path, bos="<|endoftext|>", eos="<|endoftext|>")


@pytest.fixture(scope="module")
def spm(tiny_corpus):
    return Tokenizer(tiny_corpus / "spm.model")     # byte fallback: any byte is spelt


def test_the_byte_level_table_is_gpt2_s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_level_table() == {char: byte for byte, char in bytes_to_unicode().items()}


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "sentencepiece in tokenizers"])
def test_token_bytes_joined_are_what_the_tokenizer_decodes(kind, byte_bpe, spm):
    tokenizer = {"byte-level": byte_bpe, "sentencepiece": spm,
                 "sentencepiece in tokenizers": HFTokenizer.from_sentencepiece(spm)}[kind]
    pieces = token_bytes(tokenizer, tokenizer.vocab_size + 3)
    assert pieces[tokenizer.eos_id] is None and pieces[-3:] == [None] * 3
    for ids in tokenizer.encode(TEXTS + PROMPTS):
        joined = b"".join(pieces[token] for token in ids).decode("utf-8")
        assert joined.removeprefix(" ") == tokenizer.decode(ids).removeprefix(" ")


def states(grammar, rng, count):
    """States of random walks through the grammar by allowed tokens."""
    found = []
    for _ in range(count):
        row = grammar.start()
        for _ in range(rng.randint(0, 30)):
            found.append(row.state)
            allowed = row.allowed().nonzero().flatten().tolist()
            token = rng.choice(allowed)
            if token in grammar.vocabulary.end_ids:
                break
            row.add(token)
            if row.ended:
                break
    return found


# Pattern strings without a maxLength: their plain tokens are read by a table
# (pattern_table.py).
PATTERNS_WITHOUT_MAX_LENGTH = {
    "type": "object", "properties": {
        "e": {"type": "string", "format": "email"},
        "r": {"type": "string", "pattern": "^(ab|c)+d?$"},
        "u": {"type": "string", "pattern": "\u00e9[a-z ]*", "minLength": 2},
        "t": {"type": "string", "format": "date-time"}},
    "required": ["e", "r", "u", "t"]}


# Strings of a maxLength: every token's need is found once per set of places
# (string_masks.py); an array's items are strings of one node, closed and opened again.
COUNTED_STRINGS = {
    "type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 12}},
        "e": {"type": "string", "format": "email", "maxLength": 20},
        "u": {"type": "string", "pattern": "^\u00e9[a-z ]*$", "maxLength": 7}},
    "required": ["a", "e", "u"]}


@pytest.mark.parametrize("schema, in_string", [
    ({"type": "object"}, b'{"key": "va'), ({}, b'["a", "b'), ({
        "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                         "color": {"enum": ["red", "green"]}},
        "required": ["name", "n", "color"]}, b'{"name": "Ann \\u00e9 '), ({
        "type": "object", "properties": {
            "s": {"type": "string", "maxLength": 6}, "d": {"type": "string", "format": "date"},
            "n": {"type": "integer", "minimum": 3, "maximum": 40},
            "t": {"type": ["string", "null"], "minLength": 2}},
        "required": ["s", "d", "n", "t"]}, b'{"s": "a\\n'), ({
        "type": "object", "properties": {
            "p": {"type": "string", "pattern": "^[a-z ]+(-[0-9]{2})?$", "minLength": 2,
                  "maxLength": 9},
            "q": {"type": "string", "pattern": "[xy]", "maxLength": 4}},
        "required": ["p", "q"]}, b'{"p": "ab'), (PATTERNS_WITHOUT_MAX_LENGTH, b'{"e": "an'),
    (COUNTED_STRINGS, b'{"a": ["x\\u00'), ({                 # ^ holds at count 0 alone
        "type": "object", "properties": {"z": {"pattern": "(x|^)$", "maxLength": 5}},
        "required": ["z"]}, b'{"z": "y'), ({                   # a token filling it from 0
        "type": "object", "properties": {"w": {"type": "string", "maxLength": 2}},
        "required": ["w"]}, b'{"w": "'), ({                    # '", "' opens one again
        "type": "array", "items": {"type": "string", "pattern": "^abcde", "maxLength": 8}},
        b'["abcdef')])
@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "hand-made"])
def test_a_mask_allows_exactly_the_tokens_whose_bytes_the_grammar_reads(schema, in_string,
                                                                          kind, byte_bpe, spm):
    """The trie walk, the in-string shortcut and a pattern's table against every token
    tried alone, in the states of random walks and inside a string."""
    assert_masks_exact(schema, in_string, kind, byte_bpe, spm)


def test_every_count_of_a_string_shares_one_walk_of_its_special_tokens(byte_bpe):
    """A string of a maxLength is a state per count; the tokens' needs are found once
    for them all (else every string a model writes walks the vocabulary again at each
    of its counts), and a count's mask, one comparison, is not kept (a schema's counts
    outnumber the masks a grammar keeps, and would evict those a walk found)."""
    pieces = token_bytes(byte_bpe, byte_bpe.vocab_size)
    schema = {"type": "array", "items": {"type": "string", "maxLength": 40}}
    grammar = TokenGrammar(compile_schema(schema), Vocabulary(pieces, [byte_bpe.eos_id]))
    walks = []
    walk = grammar._strings._special_needs
    grammar._strings._special_needs = lambda *place: walks.append(place) or walk(*place)
    for count in range(1, 41):
        for text in (b'["' + b"a" * count, b'["ab", "' + b"b" * count):
            grammar.allowed(advance(start(grammar.root), text))
    assert len(walks) == 2                                        # one per item's place
    assert not grammar._masks        # one comparison each: kept masks are the walked ones


def test_a_grammar_is_freed_as_soon_as_it_is_dropped(byte_bpe):
    """No reference cycle: a grammar's caches (steps, masks, needs) go with its last
    reference, not at some later pass of the garbage collector over a heap they grew."""
    pieces = token_bytes(byte_bpe, byte_bpe.vocab_size)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 9},
                                               "n": {"type": "integer", "minimum": 1}},
              "required": ["s", "n"]}
    grammar = TokenGrammar(compile_schema(schema), Vocabulary(pieces, [byte_bpe.eos_id]))
    for text in (b'{"s": "ab', b'{"s": "abc", "n": 12'):
        grammar.allowed(advance(start(grammar.root), text))
    dropped, collecting = weakref.ref(grammar), gc.isenabled()
    gc.disable()
    try:
        del grammar
        assert dropped() is None
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("kind", ["byte-level", "hand-made"])
def test_every_indentation_is_its_no_indentation_s_mask_less_the_tokens_leading_with_more(
        kind, byte_bpe):
    """After a newline each count of spaces or tabs is a state; its mask is exact against
    every token tried alone, at every count up to MAX_INDENT, in objects, arrays, a value
    after its colon and a choice, and comes from the one walk at no indentation."""
    if kind == "hand-made":
        pieces = [None, *(bytes([b]) for b in range(256)), *(b" " * j for j in range(2, 20)),
                  b"\t\t", b" \t ", b'   "', b'"a', b"    ]", b"\t}", b" \n", b"  1", b"   {",
                  b"  true", b'  "a": ', b" " * 15 + b"]", b" " * 17 + b"]", b"\t" * 16 + b'"']
        eos = 0
    else:
        pieces, eos = token_bytes(byte_bpe, byte_bpe.vocab_size), byte_bpe.eos_id
    schema = {"type": "object", "properties": {
        "a": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "object"}]},
              "maxItems": 2}, "b": {"type": "boolean"}}, "required": ["a"]}
    grammar = TokenGrammar(compile_schema(schema), Vocabulary(pieces, [eos]))
    walks = []
    walk = grammar._walk
    grammar._walk = lambda *arguments: walks.append(arguments[1]) or walk(*arguments)
    places = [b"{\n", b'{"a":\n', b'{"a": [\n', b'{"a": [1,\n', b'{"a": [{\n', b'{"a": [1]\n',
              b'{"a": [1],\n']
    for place, blank in itertools.product(places, (b" ", b"\t")):
        for count in range(17):
            state = advance(start(grammar.root), place + blank * count)
            expected = torch.tensor([bool(piece) and bool(advance(state, piece))
                                     for piece in pieces])
            if complete(state) or not expected.any():
                expected[eos] = True
            assert torch.equal(grammar.allowed(state), expected), (place, blank, count)
    assert len(walks) == len(places)                 # one walk per place, at no indentation
    assert len(grammar._masks) == len(places)        # the others, one comparison, not kept


def test_an_indentation_no_token_goes_on_from_allows_the_end_token():
    """As everywhere, a row never has no token: here every token that goes on leads with
    a space, and 16 spaces are written."""
    pieces = [None, b"[", b"\n", b" ", b" 1", b" ]"]
    grammar = TokenGrammar(compile_schema({"type": "array", "items": {"type": "integer"}}),
                           Vocabulary(pieces, [0]))
    assert grammar.allowed(advance(start(grammar.root), b"[\n" + b" " * 15)).tolist() == \
        [False, False, False, True, True, True]
    assert grammar.allowed(advance(start(grammar.root), b"[\n" + b" " * 16)).tolist() == \
        [True, False, False, False, False, False]


@pytest.mark.parametrize("kind", ["byte-level", "hand-made"])
def test_a_literal_s_walk_follows_its_next_byte_alone_and_is_exact(monkeypatch, kind,
                                                                    byte_bpe, spm):
    """In a literal (a key, an enum's value, true) the walk follows the one byte that may
    come, not every child of a trie node: exact at every node that asks (FEW_BRANCHES
    0), and a value's mask takes a few steps, not one per child of the trie's root."""
    from transduce.decode import constrained as module

    schema = {"type": "object", "properties": {
        "status": {"enum": ["pending", "shipped", "delivered", 12, None]},
        "ok": {"type": "boolean"}}, "required": ["status", "ok"]}
    monkeypatch.setattr(module, "FEW_BRANCHES", 0)
    assert_masks_exact(schema, b'{"status": "de', kind, byte_bpe, spm)
    monkeypatch.undo()
    pieces = token_bytes(byte_bpe, byte_bpe.vocab_size)
    grammar = TokenGrammar(compile_schema(schema), Vocabulary(pieces, [byte_bpe.eos_id]))
    steps = []
    step = grammar._step
    grammar._step = lambda *arguments: steps.append(arguments) or step(*arguments)
    grammar.allowed(advance(start(grammar.root), b'{"status": "deliv'))
    assert 0 < len(steps) < 10


@pytest.mark.parametrize("kind", ["byte-level", "hand-made"])
def test_masks_are_exact_where_a_patterns_table_would_be_too_large(monkeypatch, kind,
                                                                   byte_bpe, spm):
    """Past MAX_TABLE entries a pattern's plain tokens are walked instead, the same."""
    from transduce.decode import pattern_table

    monkeypatch.setattr(pattern_table, "MAX_TABLE", 24)
    assert_masks_exact(PATTERNS_WITHOUT_MAX_LENGTH, b'{"e": "an', kind, byte_bpe, spm)


def assert_masks_exact(schema, in_string, kind, byte_bpe, spm):
    if kind == "hand-made":                 # every byte, and tokens that test the walk
        pieces = [None, *(bytes([b]) for b in range(256)), b'\\q', b'\\"', b'\\u00e', b'"}',
                  b'", "', b'ab"c', "中".encode()[:2], "中".encode()[2:], "é x".encode(),
                  b'\x01a', b'true', b'": ', b'"name', b'12.5', b'\n  ']
        eos = 0
    else:
        tokenizer = byte_bpe if kind == "byte-level" else spm
        pieces, eos = token_bytes(tokenizer, tokenizer.vocab_size), tokenizer.eos_id
    grammar = TokenGrammar(compile_schema(schema), Vocabulary(pieces, [eos]))
    inside = advance(start(grammar.root), in_string)
    assert inside
    for state in [inside, *states(grammar, random.Random(0), 12)]:
        expected = torch.tensor([bool(piece) and bool(advance(state, piece))
                                 for piece in pieces])
        if complete(state) or not expected.any():
            expected[eos] = True
        assert torch.equal(grammar.allowed(state), expected)


@pytest.mark.parametrize("inside", [True, False])
@pytest.mark.parametrize("kind", ["byte-level", "hand-made"])
def test_a_mask_in_reasoning_before_json_is_every_token_tried_alone(inside, kind, byte_bpe):
    """Free text up to </think> (only tokens with a '<' walked there), then JSON."""
    if kind == "hand-made":
        pieces = [None, *(bytes([b]) for b in range(256)), b"<think>", b"</think>",
                  b"</think>\n\n", b'</think>\n\n{"', b"</think>x", b"</", b"think>", b"a<b",
                  b">\n", b">x", b"</thi", b"nk>", b"\n\n{", "é".encode()[:1]]
        eos = 0
    else:
        pieces, eos = token_bytes(byte_bpe, byte_bpe.vocab_size), byte_bpe.eos_id
    spec = json.loads(reasoning_grammar('{"json": {"type": "object"}}', inside))
    grammar = TokenGrammar(compile_grammar(spec), Vocabulary(pieces, [eos]))
    opened = b"" if inside else b"<think>"
    written = [opened + text for text in (b"", b"I count", b"a</th", b"a</think", b"</think>",
                                          b"</think>\n\n")]
    found = [advance(start(grammar.root), text) for text in written]
    assert all(found)
    for state in [*found, *states(grammar, random.Random(1), 12)]:
        expected = torch.tensor([bool(piece) and bool(advance(state, piece))
                                 for piece in pieces])
        if complete(state) or not expected.any():
            expected[eos] = True
        assert torch.equal(grammar.allowed(state), expected)


def test_a_special_token_a_grammar_names_is_allowed_where_its_marker_may_come(byte_bpe):
    """Mistral's [TOOL_CALLS], a special token (no bytes): allowed where the grammar
    reads the marker, as its symbol, and nowhere else; its text spelt out is too."""
    pieces = token_bytes(byte_bpe, byte_bpe.vocab_size) + [None, None]
    marker, other = len(pieces) - 2, len(pieces) - 1
    vocabulary = Vocabulary(pieces, [byte_bpe.eos_id],
                            specials={"[TOOL_CALLS]": marker, "[INST]": other})
    every_kind = {"type": "array", "maxItems": 2, "items": {  # a symbol meets every node
        "type": "object", "required": ["p", "n"], "properties": {
            "p": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4},
            "n": {"type": "integer", "minimum": -5, "maximum": 99},
            "s": {"type": "string"}, "x": {}, "b": {"type": "boolean"},
            "t": {"type": "array", "prefixItems": [{"type": "number"}]}}}}
    spec = {"repeat": {"sequence": [{"special": "[TOOL_CALLS]"}, {"json": every_kind}]},
            "min": 1, "max": 2}
    grammar = TokenGrammar(compile_grammar(spec), vocabulary)
    symbol = special_symbol("[TOOL_CALLS]")
    row, seen = grammar.start(), 0
    for state in [row.state, *states(grammar, random.Random(2), 40)]:
        expected = torch.tensor([bool(piece) and bool(advance(state, piece))
                                 for piece in pieces])
        expected[marker] = bool(advance(state, (symbol,)))
        if complete(state) or not expected.any():
            expected[byte_bpe.eos_id] = True
        assert torch.equal(grammar.allowed(state), expected)
        seen += int(expected[marker])
    assert seen and grammar.allowed(row.state)[marker] and not grammar.allowed(row.state)[other]
    row.add(marker)
    assert row.state == advance(start(grammar.root), b"[TOOL_CALLS]")
    assert row.allowed()[byte_bpe.encode(["["])[0][0]]


def test_constrained_logits_are_minus_infinity_where_refused_and_untouched_elsewhere(spm):
    grammar = TokenGrammar(compile_schema(SCHEMA),
                           Vocabulary(token_bytes(spm, spm.vocab_size), [spm.eos_id]))
    logits = torch.randn(3, spm.vocab_size + 2)          # a model's padded output rows
    rows = [grammar.start(), None, grammar.start()]
    out = constrained(logits, rows)
    allowed = rows[0].allowed()
    assert torch.equal(out[1], logits[1]) and torch.equal(out[0].isinf(), out[2].isinf())
    assert torch.equal(out[0, :spm.vocab_size][allowed], logits[0, :spm.vocab_size][allowed])
    assert torch.isinf(out[0, :spm.vocab_size][~allowed]).all() and torch.isinf(out[0, -2:]).all()


@pytest.fixture(scope="module", params=["sentencepiece", "byte-level"])
def generator(request, byte_bpe, spm):
    tokenizer = spm if request.param == "sentencepiece" else byte_bpe
    torch.manual_seed(0)
    vocab = tokenizer.vocab_size + 4
    model = build_model(preset("gpt-tiny", src_vocab_size=vocab, tgt_vocab_size=vocab,
                               max_positions=160)).eval()
    return Generator(model, tokenizer)


def no_whitespace(generator):
    """A logit bias that bans whitespace tokens: a random model would otherwise indent
    until its limit, and these tests want JSON that closes."""
    pieces = token_bytes(generator.tokenizer, generator.model.config.tgt_vocab_size)
    return {token: -100 for token, piece in enumerate(pieces) if piece and not piece.strip()}


def reference_greedy(generator, prompt, schema, steps, bias):
    """Greedy search by full passes, each token's bytes tried against the grammar."""
    tokenizer, model = generator.tokenizer, generator.model
    pieces = token_bytes(tokenizer, model.config.tgt_vocab_size)
    state, ids, out = start(compile_schema(schema)), generator.encode([prompt])[0], []
    banned = list(bias)
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out]))[0, -1].float()
        logits[banned] -= 100
        allowed = torch.tensor([bool(p) and bool(advance(state, p)) for p in pieces])
        if complete(state) or not allowed.any():
            allowed[list(generator.end_ids)] = True
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        if token in generator.end_ids:
            break
        out.append(token)
        state = advance(state, pieces[token])
        if ended(state):
            break
    return out


def valid_where_closed(rows, schema):
    """Each row that closed its JSON is an instance -> how many did."""
    closed = [row for row in rows if row.finish_reason == "stop"]
    for row in closed:
        assert row.end_token is None                         # closed, without an eos
        jsonschema.validate(json.loads(row.text), schema)
    return len(closed)


@pytest.mark.parametrize("schema", [SCHEMA, FINITE])
def test_greedy_under_a_schema_is_the_reference_loop_s_and_an_instance(generator, schema):
    bias = no_whitespace(generator)
    rows = generator.generate_rows(PROMPTS, max_new_tokens=120, json_schema=schema,
                                   logit_bias=bias)
    for prompt, row in zip(PROMPTS, rows):
        assert row.tokens == reference_greedy(generator, prompt, schema, 120, bias)
    closed = valid_where_closed(rows, schema)
    assert closed == len(rows) if schema is FINITE else closed > 0


@pytest.mark.parametrize("settings", [{}, {"temperature": 1.0, "seed": 3},
                                      {"temperature": 0.8, "top_p": 0.9, "seed": 4},
                                      {"temperature": 1.0, "top_k": 5, "repetition_penalty": 1.3,
                                       "seed": 5}])
def test_batched_rows_under_a_schema_equal_rows_alone(generator, settings):
    options = GenerateOptions(max_new_tokens=120, json_schema=SCHEMA,
                              logit_bias=no_whitespace(generator), **settings)
    together = generator.generate(PROMPTS, options)
    seeds = None if options.greedy else prompt_seeds(options.seed, len(PROMPTS))
    alone = [generator.generate([p], options, seeds=None if seeds is None else [seed])[0]
             for p, seed in zip(PROMPTS, seeds or [None] * len(PROMPTS))]
    assert together == alone
    assert valid_where_closed(generator.generate_rows(PROMPTS, options), SCHEMA) > 0


def test_streamed_pieces_join_to_the_whole_json(generator):
    options = GenerateOptions(max_new_tokens=120, json_schema=SCHEMA,
                              temperature=1.0, seed=9, logit_bias=no_whitespace(generator))
    whole = generator.generate(PROMPTS[:1], options)[0]
    assert "".join(generator.stream(PROMPTS[0], options)) == whole
    assert whole.lstrip().startswith("{")


def test_a_row_cut_at_its_limit_is_a_prefix_of_json_ending_for_length(generator):
    row = generator.generate_rows(PROMPTS[:1], max_new_tokens=3, json_schema=SCHEMA)[0]
    assert row.finish_reason == "length" and len(row.tokens) == 3
    state = advance(start(compile_schema(SCHEMA)), row.text.encode())
    assert state and not complete(state)


@pytest.mark.parametrize("settings, message", [
    ({"beam": 2}, "GenerateOptions.beam=2: a json_schema is followed by greedy search"),
    ({"prompt_lookup": 3}, "GenerateOptions.prompt_lookup=3"),
    ({"json_schema": "{not json"}, "GenerateOptions.json_schema: not JSON"),
    ({"json_schema": {"type": "string", "pattern": "a\\b"}},
     r"GenerateOptions\.json_schema\.pattern: a word boundary"),
])
def test_what_a_schema_cannot_go_with_is_refused_by_name(settings, message):
    settings = {"json_schema": {"type": "object"}, **settings}
    with pytest.raises(ConfigError, match=message):
        GenerateOptions(**settings)
    assert issubclass(SchemaError, ConfigError)


def test_options_keep_the_schema_as_its_json_text():
    options = GenerateOptions(json_schema={"type": "object", "properties": {"b": {}, "a": {}}})
    assert options.json_schema == '{"type": "object", "properties": {"b": {}, "a": {}}}'
    assert GenerateOptions(**options.to_dict()) == options
    hash(options)


def test_a_vocabulary_that_cannot_write_what_the_json_may_need_is_refused_by_name(spm):
    """Every byte of the schema's literals and kinds of value must be some token alone,
    else a text could meet a state no token goes on from."""
    pieces = [None, *(bytes([b]) for b in range(256) if b not in b'"]'), b'"a', b"]]"]
    vocabulary = Vocabulary(pieces, [0])
    assert TokenGrammar(compile_schema({"type": "object"}), vocabulary).unwritable() == b'"]'
    assert TokenGrammar(compile_schema({"type": "array", "items": {"type": "integer"}}),
                        vocabulary).unwritable() == b"]"
    assert TokenGrammar(compile_schema({"type": "string"}), vocabulary).unwritable() == b'"'
    assert TokenGrammar(compile_schema({"enum": [1, True]}), vocabulary).unwritable() == b""
    assert TokenGrammar(compile_schema({"type": "boolean"}),
                        Vocabulary([b"t", b"r", b"u", b"e"], [0])).unwritable() == b"afls"
    torch.manual_seed(0)
    model = build_model(preset("gpt-tiny", src_vocab_size=spm.vocab_size,
                               tgt_vocab_size=spm.vocab_size, max_positions=32)).eval()
    generator = Generator(model, spm)
    generator._vocabulary = Vocabulary([None if piece == b'"' else piece for piece in
                                        token_bytes(spm, spm.vocab_size)], [spm.eos_id])
    with pytest.raises(ConfigError, match=r"GenerateOptions\.json_schema: no token of the "
                                          r"model's vocabulary writes .* alone"):
        generator.generate(["casa"], max_new_tokens=8, json_schema={"type": "object"})


@pytest.mark.parametrize("pattern", [FORMATS["date-time"], FORMATS["email"], "^(ab|c)+d?$",
                                     "[0-9]{2,4}-x", "^\u00e9[a-z ]*$", "a.c"])
def test_a_patterns_table_gives_the_walks_needs_from_every_set_of_places(pattern):
    """PatternTable.needs against the plain tokens' trie walk, from the sets of places
    of every text of up to three characters the pattern can still complete, over
    tokens of digits, letters, dashes and accents of one to eight characters (from many
    sets few tokens can still end, and the table reads on with those alone)."""
    from transduce.decode.checked_values import CheckedString
    from transduce.decode.pattern_table import PatternTable
    from transduce.decode.regex_automaton import StringRule

    rng = random.Random(pattern)
    alphabet = "0123456789-:T.Z+@abcdé x"
    texts = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
             for _ in range(3000)} | set(alphabet)
    pieces = [None, *sorted(text.encode() for text in texts), b'"']
    node = CheckedString(StringRule(pattern))
    grammar = TokenGrammar(Root(node), Vocabulary(pieces, [0]))
    table = PatternTable(node.rule, grammar.vocabulary.plain_tokens)
    starts = {node.rule.begin[0]}
    for prefix in itertools.chain.from_iterable(
            itertools.product(alphabet, repeat=n) for n in range(1, 4)):
        places = node.rule.begin[0]
        for char in prefix:
            places = node.rule.step(places, ord(char))
        if node.rule.distance(places) < float("inf"):
            starts.add(places)
    assert len(starts) >= 3
    for places in sorted(starts):
        assert torch.equal(table.needs(places, len(pieces)),
                           grammar._strings._plain_needs_by_walk(node, places)), places
