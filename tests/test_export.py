"""The Hugging Face export (Marian for post-norm, Pegasus for pre-norm models) computes
exactly what our model computes."""

import os
import stat
import sys
import warnings

import pytest
import torch

from transduce import checkpoint
from transduce.cli import main
from transduce.config import preset
from transduce.data.tokenizer import BOS_ID, EOS_ID, MODEL_NAME, PAD_ID
from transduce.decode.search import beam_search, greedy_search
from transduce.export import ExportError, export_hf, sines_first_permutation
from transduce.model import Transformer
from transduce.model.positional import sinusoidal_table

transformers = pytest.importorskip("transformers")


def saved_model(tmp_path, tiny_corpus, **changes):
    torch.manual_seed(4)
    model = Transformer(preset("tiny", src_vocab_size=300, tgt_vocab_size=300, **changes)).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a wrong permutation shows
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(0.3 * torch.randn_like(parameter))
    path = checkpoint.save(tmp_path / "ckpt", model, None, tiny_corpus / MODEL_NAME)
    return model, path


def sources():
    src = torch.randint(4, 300, (4, 11))
    for row, length in enumerate([11, 6, 3, 9]):
        src[row, length - 1] = EOS_ID
        src[row, length:] = PAD_ID
    return src


LAYOUTS = {"marian": {}, "marian-silu": {"activation": "silu"}, "pegasus": {"norm_first": True},
           "pegasus-gelu-unscaled": {"norm_first": True, "activation": "gelu-tanh",
                                     "scale_embeddings": False}}


@pytest.fixture(params=list(LAYOUTS))
def exported(request, tmp_path, tiny_corpus):
    model, path = saved_model(tmp_path, tiny_corpus, **LAYOUTS[request.param])
    out = export_hf(path, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    expected = "Pegasus" if model.config.norm_first else "Marian"
    assert type(theirs).__name__.startswith(expected)
    return model, theirs, out


@pytest.mark.parametrize("table", ["marian", "pegasus"])
def test_permutation_maps_our_table_onto_theirs(table):
    d = 16
    ours = sinusoidal_table(30, d)
    module = getattr(transformers.models, table)
    kind = getattr(getattr(module, f"modeling_{table}"),
                   f"{table.capitalize()}SinusoidalPositionalEmbedding")
    torch.testing.assert_close(ours[:, sines_first_permutation(d)], kind(30, d).create_weight(),
                               rtol=0, atol=1e-6)


def test_logits_match(exported):
    model, theirs, _ = exported
    src = sources()
    tgt = torch.randint(4, 300, (4, 7))
    tgt[:, 0] = BOS_ID
    with torch.no_grad():
        ours = model(src, tgt)
        logits = theirs(input_ids=src, attention_mask=(src != PAD_ID).long(),
                        decoder_input_ids=tgt).logits
    torch.testing.assert_close(logits, ours, rtol=1e-4, atol=1e-4)


def generate(theirs, src, **options):
    with torch.no_grad():
        out = theirs.generate(input_ids=src, attention_mask=(src != PAD_ID).long(),
                              max_new_tokens=12, **options)
    return [[t for t in row.tolist()[1:] if t not in (PAD_ID, EOS_ID)] for row in out]


def test_greedy_and_beam_outputs_are_identical(exported):
    model, theirs, _ = exported
    src = sources()
    ours_greedy = greedy_search(model, src, bos_id=BOS_ID, eos_id=EOS_ID, max_len=12)
    ours_greedy = [[t for t in row.tolist() if t not in (PAD_ID, EOS_ID)] for row in ours_greedy]
    assert generate(theirs, src, num_beams=1, do_sample=False) == ours_greedy
    # Without a length penalty both rank finished hypotheses by log-probability.
    ours_beam = [hyps[0].tokens for hyps in beam_search(model, src, bos_id=BOS_ID, eos_id=EOS_ID,
                                                          beam=4, alpha=0.0, max_len=12)]
    assert generate(theirs, src, num_beams=4, length_penalty=0.0, early_stopping=True,
                    do_sample=False) == ours_beam


def test_generate_defaults_are_our_searchs_and_reach_the_position_limit(exported):
    model, _, out = exported
    saved = transformers.GenerationConfig.from_pretrained(out)
    assert (saved.num_beams, saved.length_penalty, saved.early_stopping) == (4, 0.6, True)
    assert saved.max_length == model.config.max_positions
    assert saved.forced_eos_token_id is None and saved.decoder_start_token_id == BOS_ID


def test_tokenizer_files_give_our_ids(exported, tiny_corpus):
    from transduce.data.tokenizer import Tokenizer

    _, _, out = exported
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    ours = Tokenizer(tiny_corpus / MODEL_NAME)
    text = "el perro come uno dos"
    assert theirs(text)["input_ids"] == ours.encode([text])[0] + [EOS_ID]


def test_unexportable_models_are_refused_naming_the_feature(tmp_path, tiny_corpus, capsys):
    _, path = saved_model(tmp_path, tiny_corpus, num_kv_heads=1, positional="rotary")
    with pytest.raises(ExportError, match="positional='rotary'.*num_kv_heads=1"):
        export_hf(path, tmp_path / "hf")
    assert main(["export", "hf", str(path), str(tmp_path / "hf2")]) == 1
    assert "cannot export to Marian" in capsys.readouterr().err


def test_the_hf_export_is_readable_as_open_would_write_it(tmp_path, tiny_corpus):
    _, path = saved_model(tmp_path, tiny_corpus)
    previous = os.umask(0o022)
    try:
        out = export_hf(path, tmp_path / "hf")
    finally:
        os.umask(previous)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}


def test_pre_norm_models_are_refused_as_pegasus_naming_the_feature(tmp_path, tiny_corpus):
    _, path = saved_model(tmp_path, tiny_corpus, norm_first=True, layer_norm_eps=1e-6)
    with pytest.raises(ExportError, match=r"cannot export to Pegasus: layer_norm_eps=1e-06"):
        export_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


ctranslate2 = pytest.importorskip("ctranslate2")


T5_LAYOUT = {"positional": "t5", "norm_first": True, "norm": "rms", "bias": False,
             "scale_embeddings": False, "gated_ffn": True, "activation": "gelu-tanh"}


@pytest.mark.parametrize("changes", [{}, {"norm_first": True}, {"positional": "learned"},
                                     {"activation": "gelu"}, {"activation": "gelu-tanh"},
                                     {"activation": "silu"}, {"scale_embeddings": False},
                                     {"norm_first": True, "norm": "rms", "gated_ffn": True,
                                      "activation": "silu", "tie_embeddings": "embeddings"},
                                     T5_LAYOUT, {**T5_LAYOUT, "head_size": 8}])
def test_ctranslate2_scores_and_greedy_output_match(tmp_path, tiny_corpus, changes):
    from transduce.data.tokenizer import Tokenizer
    from transduce.export import export_ctranslate2

    model, path = saved_model(tmp_path, tiny_corpus, **changes)
    out = export_ctranslate2(path, tmp_path / "ct2")
    pieces = Tokenizer(out / MODEL_NAME).processor.id_to_piece
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    src = sources()
    # The export appends eos itself: sources go in as SentencePiece gives them.
    source_tokens = [[pieces(t) for t in row.tolist() if t not in (PAD_ID, EOS_ID)] for row in src]
    ours = greedy_search(model, src, bos_id=BOS_ID, eos_id=EOS_ID, max_len=12)
    ours = [[t for t in row.tolist() if t not in (PAD_ID, EOS_ID)] for row in ours]
    found = translator.translate_batch(source_tokens, beam_size=1, max_decoding_length=12,
                                       min_decoding_length=0)   # ours may end at once
    theirs = [[Tokenizer(out / MODEL_NAME).processor.piece_to_id(p) for p in r.hypotheses[0]]
              for r in found]
    assert theirs == ours
    # Log-probabilities of given targets agree token by token.
    targets = [[pieces(t) for t in row] for row in ours]
    scored = translator.score_batch(source_tokens, targets)
    tgt = torch.full((4, max(len(r) for r in ours) + 2), PAD_ID)
    for row, ids in enumerate(ours):
        tgt[row, 0] = BOS_ID
        tgt[row, 1:len(ids) + 1] = torch.tensor(ids, dtype=torch.long)
        tgt[row, len(ids) + 1] = EOS_ID
    with torch.no_grad():
        log_probs = model(src, tgt[:, :-1]).log_softmax(-1)
    for row, result in enumerate(scored):
        expected = [log_probs[row, t, int(tgt[row, t + 1])].item() for t in range(len(ours[row]) + 1)]
        assert result.log_probs == pytest.approx(expected, abs=1e-4)


def test_ctranslate2_refuses_what_it_cannot_express(tmp_path, tiny_corpus, capsys):
    _, path = saved_model(tmp_path, tiny_corpus, positional="rotary", num_kv_heads=1,
                          qk_norm=True)
    assert main(["export", "ct2", str(path), str(tmp_path / "ct2")]) == 1
    err = capsys.readouterr().err
    assert "cannot export to CTranslate2: " in err
    assert "positional='rotary'" in err and "num_kv_heads=1" in err
    assert "qk_norm=True (CTranslate2's encoder-decoder does not compute it" in err


@pytest.mark.parametrize("kind, library", [("hf", "transformers"), ("ct2", "ctranslate2")])
def test_an_export_without_its_library_says_how_to_install_it(tmp_path, tiny_corpus,
                                                              monkeypatch, capsys, kind,
                                                              library):
    """transformers and ctranslate2 are the `export` extra, not the core install."""
    _, path = saved_model(tmp_path, tiny_corpus)
    monkeypatch.setitem(sys.modules, library, None)          # as if it were not installed
    assert main(["export", kind, str(path), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert f"export {kind} writes with {library}, which cannot be imported" in error
    assert "pip install 'transduce[export]'" in error and "Traceback" not in error
    assert not (tmp_path / "out").exists()
