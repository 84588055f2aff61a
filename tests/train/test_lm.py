"""Language models (arch "decoder") in the training loop and `transduce evaluate`: a toy
sequence learnt exactly in both layouts, exact resume, dev and test perplexity checked
against an independent computation, the refusals, the CLI defaults, --init, FLOPs."""

import functools
import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from transduce import checkpoint
from transduce.cli import main
from transduce.config import ConfigError, TrainConfig, preset
from transduce.data.corpus import write_text_metadata
from transduce.data.tokenizer import BOS_ID, EOS_ID, MODEL_NAME, Tokenizer, train_tokenizer
from transduce.decode.search import greedy_search
from transduce.model import build_model, load_model
from transduce.model.int8 import int8_available
from transduce.model.packed import decoding_copy
from transduce.train import loop
from tests.train.test_loop import (assert_two_processes_trained_alike,
                                   train_alone_at_double_update_freq, weights)
from transduce.train.flops import forward_flops
from transduce.train.log import LOG_NAME
from transduce.train.loop import train

WORDS = "one two three four five six seven eight nine ten eleven twelve".split()
VOCAB = 320   # every word one piece


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """A text corpus of counting lines: each starts at a random word and counts on to
    twelve, so everything after the first word is determined."""
    directory = tmp_path_factory.mktemp("counting")
    rng = random.Random(0)
    for split, size in (("train", 300), ("dev", 30), ("test", 30)):
        lines = [" ".join(WORDS[rng.randint(0, 9):]) for _ in range(size)]
        (directory / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_text_metadata(directory, "en")
    train_lines = (directory / "train.txt").read_text(encoding="utf-8").splitlines()
    train_tokenizer(train_lines, directory, vocab_size=VOCAB)
    return directory


def gpt_tiny(**changes):
    return preset("gpt-tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, **changes)


def train_config(**changes):
    values = dict(max_tokens=256, warmup_steps=20, log_every=10, eval_every=1000,
                  save_every=1000, label_smoothing=0.0, dtype="float32")
    values.update(changes)
    return TrainConfig(**values)


def continuation(model, tokenizer, context, words):
    """Greedy continuation of the line `words` after the token list `context` -> the
    line's text, prompt included."""
    prompt = context + [BOS_ID] + tokenizer.encode([" ".join(words)])[0]
    prompt = torch.tensor([prompt])                                        # (1, P)
    generated = greedy_search(model, prompt, bos_id=prompt[:, -1], eos_id=EOS_ID, max_len=20)
    ids = generated[0].tolist()
    assert EOS_ID in ids    # it stops by itself
    return tokenizer.decode(prompt[0, len(context):].tolist() + ids)


@pytest.mark.parametrize("pack_length", [0, 32], ids=["lines", "packed"])
def test_a_toy_sequence_is_learnt_exactly(counting, tmp_path, pack_length):
    """Every prompt of the counting task is continued to twelve, then eos. A packed
    model is prompted after a line of context, as packing trains it (a line starts at
    any position of a block, next to the line before it)."""
    run = tmp_path / "run"
    train(counting, run, gpt_tiny(), train_config(max_steps=200, pack_length=pack_length))
    model, tokenizer = load_model(run), Tokenizer(counting / MODEL_NAME)
    context = [BOS_ID] + tokenizer.encode(["seven eight nine ten eleven twelve"])[0] + [EOS_ID] \
        if pack_length else []
    for start in range(10):
        for end in range(start + 1, 12):
            text = continuation(model, tokenizer, context, WORDS[start:end])
            assert text == " ".join(WORDS[start:]), (WORDS[start:end], text)


@pytest.mark.parametrize("pack_length", [0, 16], ids=["lines", "packed"])
def test_resume_continues_exactly(counting, tmp_path, pack_length):
    """2N steps in one go == N steps, stop, resume, N more (mid-epoch): same weights."""
    config = dict(pack_length=pack_length, max_tokens=128, ema_decay=0.5)
    straight, split = tmp_path / "straight", tmp_path / "split"
    model_config = gpt_tiny(dropout=0.1)
    train(counting, straight, model_config, train_config(max_steps=14, **config))
    train(counting, split, model_config, train_config(max_steps=7, **config))
    position = checkpoint.load_trainer_state(checkpoint.resolve(split))["position"]
    assert position["batch"] > 0 and position["step"] == 7     # stopped mid-epoch
    train(counting, split, model_config, train_config(max_steps=14, **config), resume=True)
    for part in ("step-0000014", "ema"):
        a, b = weights(straight / part), weights(split / part)
        assert all(torch.equal(a[name], b[name]) for name in a)
    torch.manual_seed(1)
    assert not torch.equal(a["output_proj.weight"],
                           build_model(model_config).state_dict()["output_proj.weight"])


def test_two_processes_equal_one_with_double_update_freq_packed(counting, tmp_path):
    common = ["--data", str(counting), "--preset", "gpt-tiny", "--dropout", "0.0",
              "--max-tokens", "64", "--pack-length", "16", "--max-steps", "4",
              "--warmup-steps", "5", "--threads", "1", "--dtype", "float32"]
    train_alone_at_double_update_freq(tmp_path / "one", common)
    assert_two_processes_trained_alike(tmp_path / "one", tmp_path / "two", common)


def independent_nll(model, tokenizer, lines):
    """Total -log p of every line's pieces and eos, one line at a time through the
    model's logits (no batching, no chunked projection) -> (nll, pieces)."""
    total, pieces = 0.0, 0
    with torch.no_grad():
        for line in lines:
            ids = tokenizer.encode([line])[0]
            logits = model(torch.tensor([[BOS_ID] + ids]))[0]                 # (T, V)
            target = torch.tensor(ids + [EOS_ID])
            total += F.cross_entropy(logits.double(), target, reduction="sum").item()
            pieces += len(target)
    return total, pieces


def test_evaluate_reports_perplexity_per_piece_and_word(counting, tmp_path, capsys):
    run = tmp_path / "run"
    train(counting, run, gpt_tiny(), train_config(max_steps=30, eval_every=30))
    test = tmp_path / "test"
    test.mkdir()
    lines = ["one two three", "", "ten eleven twelve", "five six  seven eight"]
    (test / "test.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "eval"
    assert main(["evaluate", "--model", str(run), "--data", str(test), "--out", str(out),
                 "--batch-tokens", "64"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    model, tokenizer = load_model(run), Tokenizer(counting / MODEL_NAME)
    nll, pieces = independent_nll(model, tokenizer, [line for line in lines if line])
    words = 3 + 1 + 3 + 1 + 4 + 1         # whitespace-separated words, and each line's eos
    assert (result["lines"], result["pieces"], result["words"]) == (3, pieces, words)
    assert result["empty_lines_skipped"] == 1
    assert result["perplexity_per_piece"] == pytest.approx(math.exp(nll / pieces), rel=1e-5)
    assert result["perplexity_per_word"] == pytest.approx(math.exp(nll / words), rel=1e-5)
    assert f"perplexity {result['perplexity_per_piece']:.2f} per piece" in printed
    # The dev loss the run logged is the same measure, on the dev split.
    dev = [json.loads(line) for line in (run / LOG_NAME).open() if '"dev"' in line][-1]
    dev_lines = (counting / "dev.txt").read_text(encoding="utf-8").splitlines()
    dev_nll, dev_pieces = independent_nll(model, tokenizer, dev_lines)
    assert dev["dev_loss"] == pytest.approx(dev_nll / dev_pieces, rel=1e-5)
    assert dev["dev_ppl"] == pytest.approx(math.exp(dev_nll / dev_pieces), rel=1e-5)
    assert "dev_bleu_greedy" not in dev


def test_evaluate_leaves_out_lines_longer_than_the_model_reads(counting, tmp_path, capsys):
    run = tmp_path / "run"
    train(counting, run, gpt_tiny(max_positions=8), train_config(max_steps=2))
    test = tmp_path / "test"
    test.mkdir()
    (test / "test.txt").write_text("one two\n" + " ".join(WORDS) + "\n", encoding="utf-8")
    assert main(["evaluate", "--model", str(run), "--data", str(test), "--split", "test",
                 "--out", str(tmp_path / "eval")]) == 0
    assert "left out 1 lines longer than the model's 8 positions (lines 2" in \
        capsys.readouterr().out
    result = json.loads((tmp_path / "eval.json").read_text(encoding="utf-8"))
    assert result["lines"] == 1 and result["too_long_line_numbers"] == [2]


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_evaluate_scores_the_decoding_copy_of_the_dtype_named(counting, tmp_path, capsys, dtype):
    """--dtype scores the copy `generate --dtype` decodes with (its products 2^16 weights
    wide, so int8 converts them), against that copy scoring each line alone; auto scores
    the float32 model itself."""
    if dtype == "int8" and not int8_available():
        pytest.skip("no oneDNN int8 ops in this build")
    run = tmp_path / "run"
    train(counting, run, gpt_tiny(d_model=128, d_ff=512), train_config(max_steps=30))
    command = ["evaluate", "--model", str(run), "--data", str(counting), "--split", "test"]
    results = {}
    for given in ("auto", dtype):
        out = tmp_path / f"eval-{given}"
        assert main([*command, "--dtype", given, "--out", str(out)]) == 0
        results[given] = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert f"test ({dtype}): perplexity" in capsys.readouterr().out
    assert (results["auto"]["dtype"], results[dtype]["dtype"]) == ("float32", dtype)
    model, tokenizer = load_model(run), Tokenizer(counting / MODEL_NAME)
    lines = (counting / "test.txt").read_text(encoding="utf-8").splitlines()
    copy = decoding_copy(model, getattr(torch, dtype))
    assert any(type(layer).__name__.startswith("Int8") for layer in copy.modules()) == \
        (dtype == "int8")
    for scored, kind in ((model, "auto"), (copy, dtype)):
        nll, pieces = independent_nll(scored, tokenizer, lines)
        assert results[kind]["perplexity_per_piece"] == pytest.approx(math.exp(nll / pieces),
                                                                      rel=1e-5)
    assert results[dtype]["nll"] != pytest.approx(results["auto"]["nll"], rel=1e-5)
    assert main([*command, "--kv-dtype", "int8"]) == 2
    assert "--kv-dtype: a language model is scored over whole lines" in capsys.readouterr().err
    assert main([*command, "--no-doubles"]) == 2
    assert "--no-doubles applies to translation" in capsys.readouterr().err


@pytest.mark.parametrize("model_changes,train_changes,message", [
    ({}, {"dev_bleu_sentences": 5}, "dev_bleu_sentences=5: a language model"),
    ({"max_positions": 16}, {"pack_length": 32}, "pack_length=32: the model reads at most"),
    ({}, {"pack_length": 200, "max_tokens": 100}, "pack_length=200: a batch of max_tokens=100"),
])
def test_language_model_refusals_name_the_field(counting, tmp_path, model_changes,
                                                train_changes, message):
    with pytest.raises(ConfigError, match=message):
        train(counting, tmp_path / "run", gpt_tiny(**model_changes), train_config(**train_changes))
    assert not (tmp_path / "run").exists()


def test_each_kind_of_model_needs_its_kind_of_corpus(counting, tiny_corpus, tmp_path):
    with pytest.raises(ConfigError, match="is a text corpus, with no source side"):
        train(counting, tmp_path / "run", preset("tiny", src_vocab_size=VOCAB,
                                                 tgt_vocab_size=VOCAB), train_config())
    with pytest.raises(ConfigError, match="is a parallel corpus; give a text corpus"):
        train(tiny_corpus, tmp_path / "run", preset("gpt-tiny", src_vocab_size=300,
                                                    tgt_vocab_size=300), train_config())
    with pytest.raises(ConfigError, match="pack_length=8 packs lines .* not arch 'rnn-luong'"):
        train(tiny_corpus, tmp_path / "run", preset("tiny", src_vocab_size=300,
                                                    tgt_vocab_size=300, arch="rnn-luong"),
              train_config(pack_length=8))
    with pytest.raises(ConfigError, match="pack_length=8: packed pairs keep to themselves"):
        train(tiny_corpus, tmp_path / "run", preset("tiny", src_vocab_size=300,
                                                    tgt_vocab_size=300, attention_type="linear"),
              train_config(pack_length=8))


def test_cli_arch_decoder_defaults_to_gpt_small(counting, tmp_path, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(loop, "train", lambda data, out, model_config, train_config, **_:
                        seen.update(model=model_config, train=train_config))
    argv = ["train", "--data", str(counting), "--out", str(tmp_path / "run")]
    assert main([*argv, "--arch", "decoder", "--pack-length", "64"]) == 2   # needs a budget
    assert "--max-minutes" in capsys.readouterr().err
    assert main([*argv, "--arch", "decoder", "--pack-length", "64", "--max-minutes", "5"]) == 0
    assert seen["model"] == preset("gpt-small", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB)
    assert seen["train"].pack_length == 64
    # gpt-small's recipe: the budget schedule, no label smoothing.
    assert seen["train"].schedule == "budget" and seen["train"].label_smoothing == 0.0
    assert main([*argv, "--preset", "gpt-tiny"]) == 0
    assert seen["model"] == gpt_tiny()
    monkeypatch.undo()
    assert main([*argv, "--preset", "gpt-tiny", "--dev-bleu-sentences", "3"]) == 2
    assert "dev_bleu_sentences=3" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_cli_trains_on_from_a_language_model_checkpoint(counting, tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--data", str(counting), "--max-tokens", "128", "--dtype", "float32"]
    assert main(["train", *common, "--out", str(first), "--preset", "gpt-tiny",
                 "--max-steps", "4", "--warmup-steps", "5", "--pack-length", "32"]) == 0
    assert main(["train", *common, "--out", str(second), "--init", str(first),
                 "--max-steps", "2"]) == 0
    assert "trained 4 steps; the noam schedule continues from step 5" in capsys.readouterr().out
    model_config, train_cfg = checkpoint.read_configs(checkpoint.resolve(second))
    assert model_config == gpt_tiny() and train_cfg.schedule_offset == 4
    assert train_cfg.pack_length == 32
    assert any(not torch.equal(a, b) for a, b in zip(weights(first).values(),
                                                     weights(second).values()))


@pytest.mark.parametrize("changes", [{}, {"num_kv_heads": 2},
                                     {"gated_ffn": True, "norm": "rms", "num_kv_heads": 1},
                                     {"head_size": 8, "num_kv_heads": 2}])
def test_forward_flops_of_a_decoder_only_model_are_its_matmuls(changes):
    """Counted by PyTorch's FLOP counter on a real forward pass (naive attention, whose
    scores and weighted sum are explicit matmuls over the whole T x T square)."""
    config = gpt_tiny(attention_impl="naive", **changes)
    model = build_model(config).eval()
    tokens = torch.randint(4, VOCAB, (3, 17))
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    assert forward_flops(config, 3, 0, 17) == counter.get_total_flops()
    assert forward_flops(config, 3, 99, 17) == forward_flops(config, 3, 0, 17)


@pytest.mark.parametrize("name, changes", [("bert-tiny", {}), ("modernbert-tiny", {}),
                                           ("bert-tiny", {"embedding_size": 32}),
                                           ("deberta-tiny", {})])
def test_forward_flops_of_an_encoder_only_model_are_its_matmuls(name, changes):
    """The encoder and the pooler over [CLS], the projection of narrower embeddings
    (ELECTRA-small's); a sliding layer's scores counted over its band, 2 w + 1 keys
    (ModernBERT's: layers 1 and 2 of 3, w = 8), where the naive kernel computes the
    whole square; DeBERTa's position terms."""
    config = preset(name, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, attention_impl="naive",
                    **changes)
    model = build_model(config).eval()
    ids = torch.randint(4, VOCAB, (3, 40))
    with FlopCounterMode(display=False) as counter:
        model.pool(model(ids))
    window = config.attention_window
    unscored = 2 * 2 * 3 * 40 * (40 - (2 * window + 1)) * config.d_model * \
        sum(config.layer_attention_type(i) == "sliding" for i in range(3))
    assert forward_flops(config, 3, 40, 0) == counter.get_total_flops() - unscored
    assert (unscored > 0) == (name == "modernbert-tiny")


@pytest.mark.parametrize("changes", [{}, {"head_size": 8}, {"head_size": 24, "num_kv_heads": 2}])
def test_forward_flops_of_an_encoder_decoder_are_its_matmuls(changes):
    """The same count for the encoder-decoder (cross-attention's keys and values once
    per source), with heads of d_model / num_heads and of other widths."""
    config = preset("tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, attention_impl="naive",
                    **changes)
    model = build_model(config).eval()
    src, tgt = torch.randint(4, VOCAB, (3, 11)), torch.randint(4, VOCAB, (3, 7))
    with FlopCounterMode(display=False) as counter:
        model(src, tgt)
    assert forward_flops(config, 3, 11, 7) == counter.get_total_flops()


def test_score_lines_batches_as_it_scores_one_by_one(counting):
    from transduce.decode.evaluate import score_lines

    torch.manual_seed(0)
    model = build_model(gpt_tiny()).eval()
    tokenizer = Tokenizer(counting / MODEL_NAME)
    lines = (counting / "test.txt").read_text(encoding="utf-8").splitlines()
    ids = [np.asarray(x) for x in tokenizer.encode(lines)]
    scores = score_lines(model, ids, max_tokens=40)
    for i in (0, 7, 29):
        nll, pieces = independent_nll(model, tokenizer, [lines[i]])
        assert scores.nll[i] == pytest.approx(nll, rel=1e-5) and scores.pieces[i] == pieces


def test_the_matmul_peak_is_measured_on_a_product_the_cpu_finishes_in_time(monkeypatch):
    """2048 x 2048 where a product takes less than the half second the peak is measured
    over; a smaller one where it would not (bfloat16 on a CPU without bfloat16 units:
    13 s a product), sized by a probe's pace."""
    from transduce.train import flops

    assert flops._cpu_size(torch.float32, seconds=1e6) == 2048
    assert flops._cpu_size(torch.float32, seconds=1e-9) == 256
    clock = iter(range(10**6))
    monkeypatch.setattr(flops.time, "perf_counter", lambda: next(clock) * 0.008)
    # 8 ms for the probe: 4 s at 2048; a quarter of 0.5 s takes 640 (rounded to 128s).
    assert flops._cpu_size(torch.float32, seconds=0.5) == 640


def test_the_matmul_peak_is_measured_once_a_process_for_each_dtype_and_thread_count(
        monkeypatch):
    """A process that trains several models measures each peak once; another dtype or
    thread count (a different peak) is measured anew."""
    from transduce.train import flops

    measured = []
    monkeypatch.setattr(flops, "matmul_peak",
                        lambda dtype, device: measured.append((dtype, device)) or len(measured))
    monkeypatch.setattr(flops, "_process_peak", functools.cache(flops._process_peak.__wrapped__))
    threads = torch.get_num_threads()
    assert [flops.process_peak(torch.float32), flops.process_peak(torch.float32, "cpu"),
            flops.process_peak(torch.bfloat16), flops.process_peak(torch.float32)] == [1, 1, 2, 1]
    try:
        torch.set_num_threads(threads + 1)
        assert flops.process_peak(torch.float32) == 3
    finally:
        torch.set_num_threads(threads)
    assert measured == [(torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.float32, "cpu")]


@pytest.mark.parametrize("window,full", [(4, ()), (4, (1,)), (16, ()), (30, (0,))])
def test_forward_flops_of_sliding_layers_count_their_band(window, full):
    """A sliding layer's scores count the window before each query and the query, not
    the T x T square: the softmax model's count (its matmuls, above) less, per sliding
    layer, the keys beyond the window; as much as the square where T is within it; per
    packed pair, each pair's own band."""
    softmax = gpt_tiny(attention_impl="naive")
    sliding = gpt_tiny(attention_type="sliding", attention_window=window,
                       full_attention_layers=full)
    batch, length, q = 3, 17, softmax.num_heads * softmax.head_dim
    beyond = max(0, length - (window + 1))
    sliding_layers = softmax.num_decoder_layers - len(full)
    assert forward_flops(sliding, batch, 0, length) == forward_flops(softmax, batch, 0, length) \
        - 2 * sliding_layers * 2 * batch * length * beyond * q
    lengths = np.array([3, 17, 40])
    assert forward_flops(sliding, 1, 0, lengths).sum() == pytest.approx(
        sum(forward_flops(sliding, 1, 0, int(n)) for n in lengths))
