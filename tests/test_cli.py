import pytest

from transduce.cli import main


def test_model_info_prints_the_papers_base_size(capsys):
    assert main(["model-info", "--preset", "base", "--vocab-size", "37000"]) == 0
    out = capsys.readouterr().out
    assert "total parameters" in out and "63,082,496" in out


def test_model_info_flags_map_onto_config_fields(capsys):
    assert main(["model-info", "--preset", "tiny", "--vocab-size", "100", "--num-kv-heads", "1",
                 "--norm-first", "--positional", "rotary"]) == 0
    out = capsys.readouterr().out
    assert "num_kv_heads         1" in out and "norm_first           True" in out


def test_model_info_refuses_a_bad_config_naming_the_field(capsys):
    assert main(["model-info", "--preset", "small", "--d-model", "250"]) == 2
    assert "d_model=250" in capsys.readouterr().err


def write_corpus(directory, source, target):
    from transduce.data.corpus import write_metadata

    (directory / "train.es").write_bytes(source)
    (directory / "train.en").write_bytes(target)
    write_metadata(directory, "es", "en")


def test_vocab_on_bad_utf8_names_file_and_line(tmp_path, capsys):
    write_corpus(tmp_path, b"hola\nadi\xf3s\n", b"hello\nbye\n")
    assert main(["vocab", "--data", str(tmp_path), "--size", "50"]) == 1
    err = capsys.readouterr().err
    assert "train.es:2: invalid UTF-8" in err and "Traceback" not in err


def test_vocab_on_misaligned_files_names_both_counts(tmp_path, capsys):
    write_corpus(tmp_path, b"a\nb\nc\n", b"a\nb\n")
    assert main(["vocab", "--data", str(tmp_path)]) == 1
    assert "train.es has 3 lines but" in capsys.readouterr().err


def test_vocab_and_stats_on_a_small_corpus(tmp_path, capsys):
    words = ["uno dos tres", "cuatro cinco", "seis siete ocho nueve"]
    english = ["one two three", "four five", "six seven eight nine"]
    write_corpus(tmp_path, ("\n".join(words * 30) + "\n").encode(),
                 ("\n".join(english * 30) + "\n").encode())
    assert main(["vocab", "--data", str(tmp_path), "--size", "400"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "spm.model").is_file() and "round trip exact for 180 of 180" in out
    assert main(["data", "stats", "--data", str(tmp_path), "--max-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "90 pairs" in out and "padding" in out


def test_data_bible_without_diatheke_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["data", "bible", "--out", str(tmp_path / "bible")]) == 1
    assert "apt-get install diatheke" in capsys.readouterr().err


def test_model_info_of_an_rnn_lists_its_parts(capsys):
    assert main(["model-info", "--preset", "small", "--vocab-size", "8000",
                 "--arch", "rnn-bahdanau"]) == 0
    out = capsys.readouterr().out
    for part in ("embeddings (tied: all)", "encoder", "decoder", "attention", "readout"):
        assert part in out
    assert "KV cache" not in out


def test_train_on_a_missing_corpus_names_the_directory(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run"),
                 "--max-steps", "2"]) == 1
    assert capsys.readouterr().err == f"transduce: error: {tmp_path / 'nowhere'}: no such " \
                                      f"corpus directory\n"
    assert not (tmp_path / "run").exists()


def test_small_refusals_say_what_is_expected(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["translate", "--model", "M", "--workers", "many"])
    assert "--workers: 'many': expected 'auto' or an integer >= 1" in capsys.readouterr().err
    assert main(["average", str(tmp_path / "nowhere"), "--out", str(tmp_path / "avg")]) == 1
    assert capsys.readouterr().err.endswith("nowhere: no such run directory\n")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--objective {mlm | mlm,nsp}" in capsys.readouterr().out
