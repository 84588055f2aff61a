"""Attention maps: recorded from the pass that scores the translation, and drawn."""

import numpy as np
import pytest
import torch

from transduce import checkpoint
from transduce.attention import MultiHeadAttention, record_attention
from transduce.attention_maps import AttentionMaps, attention_maps, plot_attention_maps
from transduce.cli import main
from transduce.config import preset
from transduce.data.tokenizer import EOS_ID, MODEL_NAME, Tokenizer
from transduce.decode.generate import Continuation
from transduce.decode.translate import Translator
from transduce.model import build_model

SENTENCE = "el perro rojo come"


def translator(tiny_corpus, **changes):
    config = preset("tiny", src_vocab_size=300, tgt_vocab_size=300, max_positions=40, **changes)
    return Translator(build_model(config), Tokenizer(tiny_corpus / MODEL_NAME))


@pytest.mark.parametrize("changes", [{}, {"num_kv_heads": 2, "attention_impl": "flash"},
                                     {"attention_type": "linear"},
                                     {"attention_type": "sliding", "attention_window": 2}])
def test_transformer_maps_are_distributions_over_the_right_tokens(tiny_corpus, changes):
    maps = attention_maps(translator(tiny_corpus, **changes), SENTENCE, beam=2)
    source, targets = len(maps.source_tokens), len(maps.target_inputs)
    assert maps.source_tokens[-1] == "</s>" and maps.target_inputs[0] == "<s>"
    assert len(maps.encoder) == len(maps.decoder) == len(maps.cross) == 2
    assert maps.encoder[0].shape == (4, source, source)
    assert maps.decoder[1].shape == (4, targets, targets)
    assert maps.cross[0].shape == (4, targets, source)
    for weights in [*maps.encoder, *maps.decoder, *maps.cross]:
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    assert not maps.decoder[0].triu(diagonal=1).any()  # causal
    if changes.get("attention_type") == "sliding":
        assert not maps.encoder[0].triu(diagonal=3).any()  # window 2


# int8 converts products of 2**16 weights or more (model/int8.py): d_model 256
@pytest.mark.parametrize("dtype, size", [("bfloat16", {}), ("int8", {"d_model": 256, "d_ff": 512})])
def test_maps_of_a_model_decoding_in_reduced_precision(tiny_corpus, dtype, size):
    """The recorded pass rounds its activations otherwise than the search over its beams
    did: the score differs a little, and the maps are still given (they were refused
    for most sentences, a 500 of the server)."""
    torch.manual_seed(0)
    config = preset("tiny", src_vocab_size=300, tgt_vocab_size=300, max_positions=40, **size)
    model = build_model(config).eval()
    reduced = Translator(model, Tokenizer(tiny_corpus / MODEL_NAME), dtype=dtype)
    exact = Translator(model, Tokenizer(tiny_corpus / MODEL_NAME))
    sentences = ["el perro rojo come", "uno dos tres", "la casa grande y el gato",
                 "dos perro", "rojo rojo casa come el"]
    differences = []
    for sentence in sentences:
        maps, reference = attention_maps(reduced, sentence), attention_maps(exact, sentence)
        differences.append(abs(maps.log_prob - reference.log_prob) / abs(reference.log_prob))
        for weights in [*maps.encoder, *maps.decoder, *maps.cross]:
            torch.testing.assert_close(weights.float().sum(-1), torch.ones(weights.shape[:-1]),
                                       rtol=0, atol=2e-2)
    assert max(differences) > 1e-4         # rounded otherwise, and still within bounds


def test_maps_without_doubles_are_those_of_the_translation_without_doubles(tiny_corpus):
    """no_doubles reaches the search, and the recorded pass scores the translation as
    that search did (each input's token refused): else the score check refuses it."""
    torch.manual_seed(0)
    model = translator(tiny_corpus)
    sentences = ["el perro rojo come", "uno dos tres", "la casa grande y el gato", "dos perro"]
    free = [attention_maps(model, sentence) for sentence in sentences]
    kept = [attention_maps(model, sentence, no_doubles=True) for sentence in sentences]
    assert [maps.translation for maps in kept] == model.translate(sentences, no_doubles=True)
    assert [maps.translation for maps in free] == model.translate(sentences)
    assert [maps.translation for maps in kept] != [maps.translation for maps in free]
    for maps in kept:
        outputs = maps.target_outputs
        assert all(a != b for a, b in zip(outputs, outputs[1:]))


def no_hooks(model):
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_recording_leaves_the_model_as_it_was(tiny_corpus):
    model = translator(tiny_corpus).model
    src = torch.tensor([[5, 6, 2]])
    with torch.no_grad():
        before = model(src, src)
        with record_attention(model.attention_modules()) as recorded:
            during = model(src, src)
        after = model(src, src)
    torch.testing.assert_close(during, before, rtol=1e-5, atol=1e-6)
    assert torch.equal(after, before)
    assert no_hooks(model)
    assert [len(calls) for calls in recorded["cross"]] == [1, 1]
    assert recorded["encoder"][0][0].shape == (1, 4, 3, 3)
    with pytest.raises(RuntimeError, match="boom"), \
            record_attention(model.attention_modules()):
        raise RuntimeError("boom")
    assert no_hooks(model)


def test_recording_gives_weights_to_a_caller_who_asks_for_them():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    with record_attention({"self": [mha]}) as recorded:
        out, weights = mha(x, return_weights=True)
        plain = mha(x)
    assert isinstance(plain, torch.Tensor)
    assert torch.equal(recorded["self"][0][0], weights)
    assert recorded["self"][0][1].shape == (2, 4, 5, 5)
    torch.testing.assert_close(plain, out)


@pytest.mark.parametrize("arch", ["rnn-bahdanau", "rnn-luong"])
def test_rnn_maps_have_cross_attention_only(tiny_corpus, arch):
    maps = attention_maps(translator(tiny_corpus, arch=arch), SENTENCE)
    assert maps.encoder == [] and maps.decoder == []
    assert maps.cross[0].shape == (1, len(maps.target_outputs), len(maps.source_tokens))


def rollout_reference(layers):
    """Abnar & Zuidema's rollout from its definition, in float64 numpy: each layer's
    head mean mixed half and half with I, multiplied up from the first layer."""
    product, rolled = None, []
    for weights in layers:
        mixed = 0.5 * weights.double().mean(0).numpy() + 0.5 * np.eye(weights.shape[-1])
        product = mixed if product is None else mixed @ product
        rolled.append(product)
    return rolled


def test_a_rollout_multiplies_each_layers_mean_mixed_with_the_identity(tiny_corpus):
    """A translation's encoder and (causal) decoder self-attention rolled out: one map a
    layer, the reference's, rows that sum to 1, the decoder's causal; no cross-attention;
    a plot of one map a layer."""
    maps = attention_maps(translator(tiny_corpus, num_encoder_layers=3), SENTENCE)
    rolled = maps.rollout()
    assert rolled.cross == [] and rolled.translation == maps.translation
    for ours, theirs in ((rolled.encoder, maps.encoder), (rolled.decoder, maps.decoder)):
        assert len(ours) == len(theirs) and all(r.shape[0] == 1 for r in ours)
        for got, expected in zip(ours, rollout_reference(theirs)):
            np.testing.assert_allclose(got[0].numpy(), expected, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(got[0].sum(-1).numpy(), 1.0, atol=1e-6)
    assert not rolled.decoder[-1][0].triu(diagonal=1).any()            # causal
    assert not torch.allclose(rolled.encoder[2], rolled.encoder[0])
    assert rolled.encoder[0][0].diagonal().min() >= 0.5                # the residual's half


def test_plot_all_or_one_layer_and_head(tiny_corpus, tmp_path):
    maps = attention_maps(translator(tiny_corpus), SENTENCE)
    everything = plot_attention_maps(maps, tmp_path / "all.png")
    one = plot_attention_maps(maps, tmp_path / "one.png", layer=2, head=3)
    assert everything.stat().st_size > one.stat().st_size > 10_000


def test_pieces_are_labelled_once_a_row_and_once_a_kind(tmp_path, monkeypatch):
    """A row's heads share its queries and a kind's layers its keys: the queries are
    labelled in the first column, the keys under each kind's last layer."""
    from matplotlib.figure import Figure

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs:
                        drawn.append(figure) or save(figure, *args, **kwargs))
    source, target = ["_a", "_b", "</s>"], ["<s>", "_c", "_d", "_e"]
    layers = [torch.rand(3, 4, 4).softmax(-1) for _ in range(2)]
    cross = [torch.rand(3, 4, 3).softmax(-1) for _ in range(2)]
    encoder = [torch.rand(3, 3, 3).softmax(-1) for _ in range(2)]
    maps = AttentionMaps(source, target, target[1:] + ["</s>"], "c d e", -1.0, encoder,
                         layers, cross)
    plot_attention_maps(maps, tmp_path / "maps.png")
    axes = [axis for axis in drawn[0].axes if axis.axison]
    assert len(axes) == 3 * 2 * 3                     # kinds x layers x heads
    for index, axis in enumerate(axes):
        row, column = divmod(index, 3)
        keys = [tick.label1.get_visible() for tick in axis.xaxis.get_major_ticks()]
        queries = [tick.label1.get_visible() for tick in axis.yaxis.get_major_ticks()]
        assert keys == [row % 2 == 1] * len(keys) and queries == [column == 0] * len(queries)
    texts = [label.get_text() for label in axes[3].get_xticklabels()]
    assert texts == source and [t.get_text() for t in axes[6].get_yticklabels()] == \
        ["_c", "_d", "_e", "</s>"]


def test_a_long_sentence_is_drawn_within_the_pixel_budget(tmp_path, monkeypatch):
    """A 400-piece sentence's 12 maps would want 65-inch panels, 8 x 10^8 pixels in all:
    the panels shrink to the budget and every step-th piece is labelled."""
    from PIL import Image

    from transduce import attention_maps as module

    monkeypatch.setattr(module, "MAX_PIXELS", 4_000_000)
    pieces = [f"_w{i}" for i in range(400)]
    weights = torch.rand(4, 400, 400).softmax(-1)
    maps = AttentionMaps(pieces, pieces, pieces, "word " * 100, -1.0, [weights], [weights],
                         [weights])
    out = plot_attention_maps(maps, tmp_path / "long.png")
    width, height = Image.open(out).size
    assert width * height <= 4_000_000 * 1.01 and min(width, height) > 1000
    size, step = module._panel_size(400, 12)
    assert 12 * (size * module.DPI) ** 2 == pytest.approx(4_000_000)
    room, label = size - 1.2, module.LABEL_INCHES        # inches beside the axes; per label
    assert 400 / step * label <= room < 400 / (step - 1) * label   # the densest labels that fit
    assert module._ticks(pieces, step)[1][:2] == ["_w0", f"_w{step}"]
    assert module._panel_size(10, 12) == (3.0, 1)          # short sentences: as before
    assert module._shortened("word " * 100, 150).endswith("word…")


def test_attention_command(tiny_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    model = build_model(preset("tiny", src_vocab_size=300, tgt_vocab_size=300,
                               max_positions=40, arch="rnn-luong"))
    checkpoint.save(checkpoint.step_dir(run, 1), model, None, tiny_corpus / MODEL_NAME)
    out = tmp_path / "maps.png"
    assert main(["attention", SENTENCE, "--model", str(run), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000 and "translation:" in capsys.readouterr().out
    assert main(["attention", SENTENCE, "--model", str(run), "--out", str(out),
                 "--head", "3"]) == 2
    assert "--head 3: the model has 1 heads" in capsys.readouterr().err
    assert main(["attention", SENTENCE, "--model", str(run), "--out", str(out),
                 "--rollout"]) == 2
    assert "--rollout: this model has no self-attention layers" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["bert-tiny", "deberta-tiny"])
def test_an_encoder_s_maps_are_its_self_attention_over_the_text(tiny_corpus, name):
    """One pass over [CLS] A [SEP] (B [SEP]): every layer's weights, distributions over
    the text's pieces; DeBERTa's disentangled scores recorded as BERT's."""
    from transduce.attention_maps import encoder_attention_maps
    from transduce.decode.encode import SentenceEncoder

    torch.manual_seed(0)
    model = build_model(preset(name, src_vocab_size=300, tgt_vocab_size=300))
    encoder = SentenceEncoder(model, Tokenizer(tiny_corpus / MODEL_NAME))
    for pair in (None, "uno dos"):
        maps = encoder_attention_maps(encoder, SENTENCE, pair)
        pieces = encoder.item_ids([SENTENCE])[0] if pair is None else None
        length = len(maps.source_tokens)
        if pieces is not None:
            assert length == len(pieces)
        assert (maps.source_tokens[0], maps.source_tokens[-1]) == ("<s>", "</s>")
        assert maps.source_tokens.count("</s>") == (1 if pair is None else 2)
        assert (maps.decoder, maps.cross, maps.log_prob) == ([], [], None)
        assert len(maps.encoder) == 2 and maps.encoder[1].shape == (4, length, length)
        for weights in maps.encoder:
            torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))


def test_a_language_model_s_maps_cover_the_prompt_and_its_continuation(tiny_corpus):
    """The prompt and its greedy continuation in one causal pass, whose score of the
    continuation is the generator's own."""
    from transduce.attention_maps import generation_attention_maps
    from transduce.decode.generate import Generator

    torch.manual_seed(0)
    model = build_model(preset("gpt-tiny", src_vocab_size=300, tgt_vocab_size=300))
    generator = Generator(model, Tokenizer(tiny_corpus / MODEL_NAME))
    maps = generation_attention_maps(generator, SENTENCE, max_new_tokens=5)
    prompt = generator.encode([SENTENCE])[0]
    continuation = generator.generate_rows([SENTENCE], max_new_tokens=5)[0].tokens
    tokens = prompt + continuation
    assert maps.target_inputs == [generator.tokenizer.piece(i) for i in tokens[:-1]]
    assert maps.target_outputs == [generator.tokenizer.piece(i) for i in tokens[1:]]
    assert (maps.encoder, maps.cross) == ([], [])
    scored = generator.token_logprobs([tokens])[0].logprobs          # of tokens[1:]
    assert maps.log_prob == pytest.approx(sum(scored[len(prompt) - 1:]), abs=1e-4)
    for weights in maps.decoder:
        assert weights.shape == (4, len(tokens) - 1, len(tokens) - 1)
        assert not weights.triu(diagonal=1).any()                           # causal
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))


@pytest.mark.parametrize("kept", [0, 2])
def test_a_continuation_ended_by_eos_is_drawn_up_to_the_eos(tiny_corpus, monkeypatch, kept):
    """A continuation that eos ended (after `kept` tokens; 0: at once): the last position
    the model read, which predicted the eos, is drawn, and the eos is scored."""
    from transduce.attention_maps import generation_attention_maps
    from transduce.decode.generate import Generator

    torch.manual_seed(0)
    model = build_model(preset("gpt-tiny", src_vocab_size=300, tgt_vocab_size=300))
    generator = Generator(model, Tokenizer(tiny_corpus / MODEL_NAME))
    found = generator.generate_rows([SENTENCE], max_new_tokens=kept)[0] if kept else None
    ended = Continuation(generator.tokenizer, (), tokens=found.tokens if kept else [],
                         finished=True, ended=True, end_token=EOS_ID)
    monkeypatch.setattr(generator, "generate_rows", lambda prompts, **settings: [ended])
    maps = generation_attention_maps(generator, SENTENCE, max_new_tokens=5)
    read = generator.encode([SENTENCE])[0] + ended.tokens
    piece = generator.tokenizer.piece
    assert maps.target_inputs == [piece(i) for i in read]
    assert maps.target_outputs == [piece(i) for i in read[1:] + [EOS_ID]]
    assert maps.translation == SENTENCE + ended.text
    scored = generator.token_logprobs([read + [EOS_ID]])[0].logprobs
    assert maps.log_prob == pytest.approx(sum(scored[len(read) - kept - 1:]), abs=1e-4)
    assert maps.decoder[0].shape == (4, len(read), len(read))


def test_attention_command_draws_each_shape(tiny_corpus, tmp_path, capsys):
    """An encoder-only model's text (and pair), a language model's continuation; --pair
    is refused for a shape that has no pairs."""
    for name, said in (("bert-tiny", "text: "), ("gpt-tiny", "continued: ")):
        run = tmp_path / name
        model = build_model(preset(name, src_vocab_size=300, tgt_vocab_size=300))
        checkpoint.save(checkpoint.step_dir(run, 1), model, None, tiny_corpus / MODEL_NAME)
        out = tmp_path / f"{name}.png"
        assert main(["attention", SENTENCE, "--model", str(run), "--out", str(out),
                     "--max-new-tokens", "3", "--layer", "1"]) == 0
        assert out.stat().st_size > 10_000 and said in capsys.readouterr().out
        rolled = tmp_path / f"{name}-rollout.png"
        assert main(["attention", SENTENCE, "--model", str(run), "--out", str(rolled),
                     "--max-new-tokens", "3", "--rollout"]) == 0
        assert rolled.stat().st_size > 10_000 and said in capsys.readouterr().out
    assert main(["attention", SENTENCE, "--model", str(tmp_path / "bert-tiny"), "--out",
                 str(out), "--pair", "uno dos"]) == 0
    assert "text: el perro rojo come | uno dos" in capsys.readouterr().out
    assert main(["attention", SENTENCE, "--model", str(tmp_path / "gpt-tiny"), "--out",
                 str(out), "--pair", "uno"]) == 2
    assert "--pair is the second text of an encoder-only model's pair" in \
        capsys.readouterr().err
    assert main(["attention", SENTENCE, "--model", str(tmp_path / "gpt-tiny"), "--out",
                 str(out), "--rollout", "--head", "1"]) == 2
    assert "--head with --rollout: a rollout averages every head" in capsys.readouterr().err


def test_attention_command_without_doubles(tiny_corpus, tmp_path, capsys):
    torch.manual_seed(0)
    run = tmp_path / "run"
    model = build_model(preset("tiny", src_vocab_size=300, tgt_vocab_size=300, max_positions=40))
    checkpoint.save(checkpoint.step_dir(run, 1), model, None, tiny_corpus / MODEL_NAME)
    loaded = Translator.load(run)
    sentence = next(s for s in ["el perro rojo come", "uno dos tres", "la casa grande y el gato"]
                    if loaded.translate([s]) != loaded.translate([s], no_doubles=True))
    kept = loaded.translate([sentence], no_doubles=True)[0]
    out = tmp_path / "maps.png"
    assert main(["attention", sentence, "--model", str(run), "--out", str(out),
                 "--no-doubles", "--layer", "1"]) == 0
    assert f"translation: {kept}  (" in capsys.readouterr().out
