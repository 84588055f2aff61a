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
