"""The Python API and the translate / evaluate / kv-size commands."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from transduce import checkpoint, load
from transduce.cli import main
from transduce.config import ConfigError, preset
from transduce.data.tokenizer import BOS_ID, EOS_ID, MODEL_NAME
from transduce.decode import options as options_module
from transduce.decode.inputs import TextError
from transduce.decode.options import decoding_dtype
from transduce.decode.search import beam_search
from transduce.decode.translate import (InputTooLong, Translation, length_sorted_batches,
                                        pad_sources)
from transduce.errors import LineTruncated
from transduce.model import Transformer, build_model, load_model
from transduce.model import int8 as int8_module
from transduce.model import int8_rows
from transduce.model import packed as packed_module
from transduce.model.int8_vnni import Int8VnniLinear
from transduce.model.packed import packing_available
from tests.environment import subprocess_env

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tiny_corpus, tmp_path_factory):
    """A checkpoint of an untrained tiny model with the toy corpus's tokenizer."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=300, tgt_vocab_size=300, max_positions=40))
    run = tmp_path_factory.mktemp("run")
    checkpoint.save(checkpoint.step_dir(run, 1), model, None, tiny_corpus / MODEL_NAME)
    return run


def test_n_lines_in_n_lines_out_in_order(run_dir):
    translator = load(run_dir)
    lines = ["uno dos tres casa", "", "el perro", "   ", "gato rojo grande come el perro"]
    outputs = translator.translate(lines, beam=2)
    assert len(outputs) == 5 and outputs[1] == "" and outputs[3] == ""
    # Sorting by length inside must not mix lines up: each alone gives the same output.
    for line, output in zip(lines, outputs):
        assert translator.translate([line], beam=2) == [output]


def test_nbest_lists_with_scores(run_dir):
    translator = load(run_dir)
    results = translator.translate_nbest(["el perro come", ""], nbest=3, beam=3)
    assert len(results) == 2 and len(results[0]) == 3
    assert all(isinstance(t, Translation) for t in results[0])
    assert [t.score for t in results[0]] == sorted((t.score for t in results[0]), reverse=True)
    assert results[0][0].text == translator.translate(["el perro come"], beam=3)[0]
    assert [t.text for t in results[1]] == ["", "", ""]


@pytest.mark.parametrize("options,message", [
    ({"beam": 0}, "beam=0: must be a positive integer"),
    ({"beam": -3}, "beam=-3"),
    ({"alpha": float("nan")}, "alpha=nan: must be a finite number"),
    ({"alpha": -1.0}, "alpha=-1.0"),
    ({"batch_tokens": 0}, "batch_tokens=0"),
    ({"batch_tokens": -5}, "batch_tokens=-5"),
    ({"batch_sentences": -1}, "batch_sentences=-1"),
])
def test_the_api_refuses_bad_options_naming_them(run_dir, options, message):
    translator = load(run_dir)
    with pytest.raises(ConfigError, match=message):
        translator.translate(["el perro"], **options)
    with pytest.raises(ConfigError, match="nbest=5: must be at most beam=4"):
        translator.translate_nbest(["el perro"], nbest=5, beam=4)
    for bad in ({"dtype": "float16"}, {"kv_dtype": "int2"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            load(run_dir, **bad)


@pytest.mark.parametrize("device,message", [
    ("tpu", "device='tpu': not a device PyTorch knows"),
    (7.5, "device=7.5: not a device PyTorch knows"),
    pytest.param("cuda", "device='cuda': this PyTorch sees no CUDA GPU", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA GPU is there to load onto"))])
def test_a_device_it_cannot_load_onto_is_named_not_the_weights(run_dir, device, message):
    with pytest.raises(ConfigError, match=message):
        load(run_dir, device=device)


@pytest.mark.parametrize("flags,message", [
    (["--beam", "0"], "argument --beam: 0: must be a positive integer"),
    (["--beam", "-3"], "argument --beam: -3: must be a positive integer"),
    (["--beam", "four"], "argument --beam: 'four' is not an integer"),
    (["--alpha", "nan"], "argument --alpha: nan: must be a finite number >= 0"),
    (["--batch-tokens", "0"], "argument --batch-tokens: 0: must be a positive integer"),
    (["--batch-tokens", "-5"], "argument --batch-tokens: -5: must be a positive integer"),
    (["--batch-sentences", "-1"], "argument --batch-sentences: -1: must be an integer >= 0"),
])
def test_the_cli_refuses_bad_options_before_loading_the_model(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as stop:   # the model does not even exist
        main(["translate", "--model", str(tmp_path / "absent"), *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and "Traceback" not in err


def test_the_cli_refuses_more_nbest_than_beam(run_dir, capsys):
    assert main(["translate", "--model", str(run_dir), "--nbest", "5", "--beam", "4"]) == 2
    assert "--nbest 5: must be at most --beam (4)" in capsys.readouterr().err


def test_long_lines_are_truncated_with_a_warning_or_refused(run_dir):
    translator = load(run_dir)
    long_line = " ".join(["perro"] * 200)
    with pytest.warns(LineTruncated, match="line 2: .* truncated"):
        outputs = translator.translate(["el gato", long_line], beam=1)
    assert len(outputs) == 2
    with pytest.raises(InputTooLong, match="line 2"):
        translator.translate(["el gato", long_line], strict=True)


def test_translate_command_on_files(run_dir, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("uno dos\n\nel gato\n", encoding="utf-8")
    output = tmp_path / "out.txt"
    assert main(["translate", "--model", str(run_dir), "--input", str(source),
                 "--output", str(output), "--beam", "2"]) == 0
    lines = output.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""
    assert main(["translate", "--model", str(run_dir), "--input", str(source), "--nbest", "2"]) == 0
    nbest = capsys.readouterr().out.splitlines()
    assert len(nbest) == 6 and nbest[0].startswith("0 ||| ") and nbest[4].startswith("2 ||| ")


def test_no_doubles_reaches_the_search_from_the_command_and_the_evaluation(
        run_dir, tiny_corpus, tmp_path, capsys):
    """--no-doubles: the untrained model's repeated pieces go (its outputs differ from the
    free search's), as Translator.translate(no_doubles=True) gives them, and an
    evaluation records it."""
    translator = load(run_dir)
    lines = ["uno dos tres casa", "el perro", "gato rojo grande come el perro"]
    free, kept = translator.translate(lines), translator.translate(lines, no_doubles=True)
    assert free != kept
    source = tmp_path / "in.txt"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    # float32 as load() decodes (--dtype auto is bfloat16 on a CPU with AMX)
    assert main(["translate", "--model", str(run_dir), "--input", str(source),
                 "--no-doubles", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.splitlines() == kept
    prefix = tmp_path / "eval"
    assert main(["evaluate", "--model", str(run_dir), "--data", str(tiny_corpus), "--split",
                 "test", "--no-doubles", "--out", str(prefix)]) == 0
    assert json.loads(prefix.with_suffix(".json").read_text())["no_doubles"] is True


def test_one_string_or_a_non_string_is_refused_naming_the_line(run_dir):
    translator = load(run_dir)
    with pytest.raises(TextError, match="got one str"):
        translator.translate("el gato")
    with pytest.raises(TextError, match="line 2: a NoneType"):
        translator.translate(["el gato", None])


def test_translate_command_names_the_file_of_a_line_too_long(run_dir, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("el gato\n" + " ".join(["perro"] * 200) + "\n", encoding="utf-8")
    assert main(["translate", "--model", str(run_dir), "--input", str(source), "--beam", "1"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2
    assert captured.err.splitlines() == [f"transduce: warning: {source}: line 2: 1000 tokens, "
                                         f"truncated to the model's limit of 39"]
    assert main(["translate", "--model", str(run_dir), "--input", str(source), "--strict"]) == 1
    assert capsys.readouterr().err == (f"transduce: error: {source}: line 2: 1000 tokens, more "
                                       f"than the model's limit of 39\n")


def test_translate_command_names_bad_utf8(run_dir, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_bytes(b"uno\n\xffdos\n")
    assert main(["translate", "--model", str(run_dir), "--input", str(source)]) == 1
    assert "in.txt:2: invalid UTF-8" in capsys.readouterr().err


def test_interactive_lines_are_answered_as_they_are_typed(run_dir):
    env = subprocess_env()
    process = subprocess.Popen([sys.executable, "-m", "transduce", "translate", "--model",
                                str(run_dir), "--beam", "1"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                               bufsize=1)
    try:
        for line in ["el perro", "uno dos tres"]:
            process.stdin.write(line + "\n")
            process.stdin.flush()
            start = time.time()
            answer = process.stdout.readline()  # arrives while stdin is still open
            assert answer.endswith("\n") and time.time() - start < 60
        process.stdin.close()
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()


def test_evaluate_writes_hypotheses_and_scores(run_dir, tiny_corpus, tmp_path, capsys):
    prefix = tmp_path / "eval"
    assert main(["evaluate", "--model", str(run_dir), "--data", str(tiny_corpus), "--split", "test",
                 "--beam", "2", "--out", str(prefix)]) == 0
    result = json.loads(prefix.with_suffix(".json").read_text())
    assert result["sentences"] == 30
    assert {"bleu", "chrf", "bleu_signature", "sentences_per_second"} <= set(result)
    assert "nrefs:1|case:mixed|eff:no|tok:13a" in result["bleu_signature"]
    assert len(prefix.with_suffix(".hyp").read_text().splitlines()) == 30
    assert "BLEU" in capsys.readouterr().out


@pytest.mark.parametrize("kv_heads,expected", [(None, 12_582_912), (1, 1_572_864)])
def test_kv_size_formula_matches_measured_buffers(capsys, kv_heads, expected):
    argv = ["kv-size", "--preset", "base", "--tokens", "128", "--batch", "4"]
    if kv_heads:
        argv += ["--num-kv-heads", str(kv_heads)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"formula:  {expected:,d}" in out and f"measured: {expected:,d}" in out


def test_evaluate_warns_when_the_corpus_is_not_the_pair_the_model_learned(
        tiny_corpus, tmp_path, capsys):
    import shutil

    from transduce.data.corpus import write_metadata

    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=300, tgt_vocab_size=300, max_positions=40))
    model.languages = ("es", "en")
    run = checkpoint.save(tmp_path / "run", model, None, tiny_corpus / MODEL_NAME)
    reversed_ = tmp_path / "reversed"
    shutil.copytree(tiny_corpus, reversed_)
    write_metadata(reversed_, "en", "es")
    for data, warned in ((tiny_corpus, False), (reversed_, True)):
        assert main(["evaluate", "--model", str(run), "--data", str(data), "--beam", "1",
                     "--out", str(tmp_path / "eval")]) == 0
        err = capsys.readouterr().err
        assert ("transduce: warning: the model was trained to translate es -> en, but "
                f"{reversed_} is en -> es") in err if warned else "warning" not in err


def test_evaluate_refuses_misaligned_references(run_dir, tiny_corpus, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_corpus, data)
    (data / "test.ref2").write_text("only one line\n", encoding="utf-8")
    assert main(["evaluate", "--model", str(run_dir), "--data", str(data), "--beam", "1",
                 "--out", str(tmp_path / "eval")]) == 1
    assert "test.ref2 has 1 lines but" in capsys.readouterr().err


def test_batch_sentence_cap_and_bfloat16_keep_outputs(run_dir):
    lines = [" ".join(["uno", "dos", "casa"][: 1 + i % 3]) for i in range(10)]
    translator = load(run_dir)
    reference = translator.translate(lines, beam=2)
    batches = length_sorted_batches(translator.tokenizer.encode(lines), 4096, 3)
    assert max(len(b) for b in batches) == 3 and sorted(sum(batches, [])) == list(range(10))
    assert translator.translate(lines, beam=2, batch_sentences=3) == reference
    assert len(load(run_dir, dtype="bfloat16").translate(lines, beam=2)) == 10
    with pytest.raises(ValueError, match="dtype"):
        load(run_dir, dtype="int4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_in_place_decodes_with_the_model_itself_as_a_copy_would(run_dir, dtype):
    """load() hands its own model over (in_place): one copy in memory, not two, and the
    same translations as a copy of it gives."""
    from transduce.decode.translate import Translator
    if dtype == "int8" and not int8_module.int8_available():
        pytest.skip("oneDNN's int8 ops are not in this build")
    lines = ["uno dos casa", "dos", "casa casa uno dos"]
    tokenizer = load(run_dir).tokenizer
    given = load_model(run_dir)
    copied = Translator(given, tokenizer, dtype=dtype)
    assert copied.model is not given and next(given.parameters()).dtype == torch.float32
    converted = Translator(given, tokenizer, dtype=dtype, in_place=True)
    assert converted.model is given
    assert converted.translate(lines, beam=2) == copied.translate(lines, beam=2)
    assert load(run_dir, dtype=dtype).translate(lines, beam=2) == copied.translate(lines, beam=2)


@pytest.mark.parametrize("flags,expected", [
    (["--dtype", "int8"], 2 * 6 * 8 * (64 + 4) * 128 * 4),                   # values + scales
    (["--dtype", "int4"], 2 * 6 * 8 * (32 + 2 * 4) * 128 * 4),               # 2 groups of 32
    (["--attention-type", "sliding", "--attention-window", "16"], 2 * 6 * 8 * 64 * 4 * 16 * 4),
    (["--attention-type", "linear"], 6 * 8 * (64 * 64 + 64) * 4 * 4),       # no length at all
])
def test_kv_size_of_quantized_sliding_and_linear_caches(capsys, flags, expected):
    assert main(["kv-size", "--preset", "base", "--tokens", "128", "--batch", "4", *flags]) == 0
    out = capsys.readouterr().out
    assert f"formula:  {expected:,d}" in out and f"measured: {expected:,d}" in out


def test_kv_size_refuses_what_has_no_kv_cache(capsys):
    assert main(["kv-size", "--preset", "small", "--arch", "rnn-luong", "--tokens", "8"]) == 2
    assert "keeps no KV cache" in capsys.readouterr().err
    assert main(["kv-size", "--preset", "small", "--attention-type", "linear", "--tokens", "8",
                 "--dtype", "int8"]) == 2
    assert "int8" in capsys.readouterr().err


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_kv_caches_translate_and_rnn_refuses_them(run_dir, tiny_corpus, tmp_path,
                                                            capsys, kv_dtype):
    lines = ["uno dos tres casa", "el perro", "gato rojo grande come el perro"]
    quantized = load(run_dir, kv_dtype=kv_dtype).translate(lines, beam=2)
    assert len(quantized) == 3
    assert main(["evaluate", "--model", str(run_dir), "--data", str(tiny_corpus), "--beam", "2",
                 "--kv-dtype", kv_dtype]) == 0
    assert (run_dir / f"eval-test-beam2-kv{kv_dtype}.json").is_file()
    rnn = preset("tiny", src_vocab_size=300, tgt_vocab_size=300, arch="rnn-luong")
    rnn_run = tmp_path / "rnn"
    checkpoint.save(checkpoint.step_dir(rnn_run, 1), build_model(rnn), None,
                    tiny_corpus / MODEL_NAME)
    assert main(["translate", "--model", str(rnn_run), "--kv-dtype", kv_dtype,
                 "--input", str(tiny_corpus / "test.es")]) == 2
    assert f"kv_dtype='{kv_dtype}'" in capsys.readouterr().err


def test_max_length_caps_each_output_and_is_checked(run_dir):
    from transduce.data.tokenizer import BOS_ID, EOS_ID
    from transduce.decode.search import beam_search
    from transduce.decode.translate import pad_sources

    translator = load(run_dir)
    for line in ["uno dos tres casa", "el perro"]:
        ids = translator.tokenizer.encode([line])[0]
        with torch.inference_mode():
            free = beam_search(translator.model, pad_sources([ids]), bos_id=BOS_ID,
                               eos_id=EOS_ID, beam=1)[0][0].tokens
        assert len(free) > 3
        # greedy choices do not depend on the limit: the capped output is the prefix
        capped = translator.translate([line], beam=1, max_length=3)[0]
        assert capped == translator.tokenizer.decode(free[:3])
    for bad in (0, -1, 2.5):
        with pytest.raises(ConfigError, match="max_length"):
            translator.translate(["uno"], max_length=bad)


@pytest.mark.parametrize("flags,device,int8_ops,expected", [
    ({"amx_bf16", "avx512_bf16", "avx512_vnni"}, "cpu", True, "bfloat16"),  # Sapphire Rapids
    ({"avx512_bf16", "avx512_vnni"}, "cpu", True, "int8"),                   # a Zen 4
    ({"avx_vnni"}, "cpu", True, "int8"),                                     # AVX-VNNI cores
    ({"avx512_vnni"}, "cpu", False, "float32"),       # a PyTorch without oneDNN's int8 ops
    ({"avx2", "fma", "f16c"}, "cpu", True, "int8"),   # AVX2 alone (a Zen 3): 7-bit rows
    ({"avx2", "fma"}, "cpu", False, "float32"),
    (set(), "cpu", True, "float32"),
    ({"amx_bf16", "avx512_vnni"}, "cuda", True, "float32"),
])
def test_auto_dtype_picks_by_the_cpu(monkeypatch, flags, device, int8_ops, expected):
    monkeypatch.setattr(options_module, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(int8_module, "int8_available", lambda: int8_ops)
    assert decoding_dtype("auto", device) == expected
    assert decoding_dtype("float32", device) == "float32"
    with pytest.raises(ConfigError, match="dtype='float16': choose one of auto, float32, "
                                          "bfloat16, int8"):
        decoding_dtype("float16", device)
    if device != "cpu" or not int8_ops:
        with pytest.raises(ConfigError, match="dtype='int8' decodes on a CPU"):
            decoding_dtype("int8", device)


@pytest.mark.parametrize("parameters,int8_ops,expected", [
    (0, True, "bfloat16"),                                  # not a language model
    (options_module.AMX_INT8_LM_PARAMETERS - 1, True, "bfloat16"),
    (options_module.AMX_INT8_LM_PARAMETERS, True, "int8"),
    (options_module.AMX_INT8_LM_PARAMETERS, False, "bfloat16"),
])
def test_auto_dtype_on_amx_generates_with_a_large_language_model_in_int8(
        monkeypatch, parameters, int8_ops, expected):
    """A step of a few rows streams every weight from memory: int8 reads half the bytes."""
    monkeypatch.setattr(options_module, "cpu_flags",
                        lambda: frozenset({"amx_bf16", "avx512_bf16", "avx512_vnni"}))
    monkeypatch.setattr(int8_module, "int8_available", lambda: int8_ops)
    assert decoding_dtype("auto", "cpu", parameters) == expected
    assert decoding_dtype("auto", "cuda", parameters) == "float32"
    assert decoding_dtype("bfloat16", "cpu", parameters) == "bfloat16"
    monkeypatch.setattr(options_module, "cpu_flags", lambda: frozenset({"avx512_vnni"}))
    assert decoding_dtype("auto", "cpu", parameters) == ("int8" if int8_ops else "float32")


@pytest.mark.parametrize("rows_kernel", [True, False])
def test_auto_dtype_on_avx2_alone_generates_in_int8_with_the_rows_kernel(monkeypatch,
                                                                         rows_kernel):
    """Without VNNI, oneDNN's int8 translated faster but generated slower; the rows
    kernel generated faster (decoding_dtype)."""
    monkeypatch.setattr(options_module, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(int8_module, "int8_available", lambda: True)
    monkeypatch.setattr(int8_rows.KERNEL, "loaded", rows_kernel)
    assert decoding_dtype("auto", "cpu") == "int8"
    for parameters in (1, options_module.AMX_INT8_LM_PARAMETERS):
        assert decoding_dtype("auto", "cpu", parameters) == ("int8" if rows_kernel else "float32")


def test_auto_dtype_decodes_in_the_type_it_picked(run_dir, monkeypatch):
    monkeypatch.setattr(options_module, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    translator = load(run_dir, dtype="auto")
    assert translator.dtype == "bfloat16"
    assert next(translator.model.parameters()).dtype == torch.bfloat16
    monkeypatch.setattr(options_module, "cpu_flags", lambda: frozenset())
    assert load(run_dir, dtype="auto").dtype == "float32"
    if int8_module.int8_available():
        monkeypatch.setattr(options_module, "cpu_flags", lambda: frozenset({"avx512_vnni"}))
        monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)
        translator = load(run_dir, dtype="auto")
        assert translator.dtype == "int8"
        assert any(isinstance(m, (int8_module.Int8Linear, Int8VnniLinear))
                   for m in translator.model.modules())


@pytest.mark.skipif(not int8_module.int8_available(), reason="no oneDNN int8 ops in this build")
@pytest.mark.parametrize("packed", [True, False])
def test_int8_translations_are_the_same_alone_and_in_a_batch(run_dir, monkeypatch, packed):
    """Activations quantized per row: a sentence's int8 products do not depend on its
    batch mates, greedy or beam, with the other products packed or (forced) plain."""
    if packed and not packing_available(torch.float32):
        pytest.skip("no oneDNN in this build")
    monkeypatch.setattr(packed_module, "packing_available", lambda dtype=None: packed)
    monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)     # every product in int8
    translator = load(run_dir, dtype="int8")
    assert not any(type(m) is torch.nn.Linear for m in translator.model.modules())
    lines = ["uno dos tres casa", "el perro", "gato rojo grande come el perro", "casa"]
    for beam in (1, 3):
        got = translator.translate(lines, beam=beam)
        assert all(isinstance(text, str) for text in got)
        assert [translator.translate([line], beam=beam)[0] for line in lines] == got


@pytest.mark.parametrize("packed", [True, False])
def test_the_decoding_copy_translates_as_the_checkpoints_own_model(run_dir, monkeypatch, packed):
    """The copy Translator decodes with (projections fused; Linear layers packed, or the
    plain fallback forced) gives the model's own greedy and beam translations, and each
    line alone gives what it gives in the batch."""
    if packed and not packing_available(torch.float32):
        pytest.skip("no oneDNN in this build")
    monkeypatch.setattr(packed_module, "packing_available", lambda dtype=None: packed)
    translator = load(run_dir)
    model = load_model(checkpoint.resolve(run_dir)).eval()
    lines = ["uno dos tres casa", "el perro", "gato rojo grande come el perro", "casa"]
    src = pad_sources(translator.encode(lines))
    for beam in (1, 3):
        expected = beam_search(model, src, bos_id=BOS_ID, eos_id=EOS_ID, beam=beam)
        got = translator.translate(lines, beam=beam)
        assert got == [translator.tokenizer.decode(found[0].tokens) for found in expected]
        assert [translator.translate([line], beam=beam)[0] for line in lines] == got
