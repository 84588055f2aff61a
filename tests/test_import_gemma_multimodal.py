"""Hugging Face Gemma 3 with vision (Gemma3ForConditionalGeneration: gemma-3-4b, 12b,
27b) -> our checkpoint: its language model, read from either layout of the stored names
and from a text_config that names only what differs from Gemma3TextConfig's defaults
(as the published ones do), computes transformers' text logits and greedy tokens; the
vision tower is left out, and the processor's chat template is read."""

import json

import pytest
import torch
from safetensors.torch import load_file

from transduce.cli import main
from transduce.data.chat import Chat
from transduce.decode.generate import Generator
from transduce.importers import import_gemma
from transduce.model import load_model
from tests.foreign_checkpoints import assert_refused, assert_same_greedy_tokens, \
    assert_same_logits, damaged
from tests.test_import_gemma import ATOL, gemma_tokenizer  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")

VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, image_size=28, patch_size=7)
# 27B's choices in small: heads of 8 scored over sqrt(12), an untied output does not
# occur there, but grouped-query attention, a linear-scaled full layer and a window do.
TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12, sliding_window=6,
            max_position_embeddings=96, rope_scaling={"rope_type": "linear", "factor": 4.0})
# The published 4B's text_config in small: the rest is Gemma3TextConfig's defaults
# (vocabulary 262,208, 8 heads of 256 sharing 4, one layer in six full, bases 10,000 and
# 1,000,000, query_pre_attn_scalar 256).
PUBLISHED_TEXT = dict(hidden_size=32, intermediate_size=64, model_type="gemma3_text",
                      num_hidden_layers=6, rope_scaling={"factor": 8.0, "rope_type": "linear"},
                      sliding_window=8)
TOP_LEVEL = dict(mm_tokens_per_image=4, boi_token_index=297, eoi_token_index=298,
                 image_token_index=299)


def multimodal_checkpoint(directory, tokenizer_dir, text_config, seed=0):
    """A random Gemma3ForConditionalGeneration saved as transformers writes it (its
    language model under language_model.model., as in the published files), its norm
    weights drawn around 1 (see tests/test_import_gemma.py), with the tokenizer's files
    and config.json's end tokens listed at the top level, as the published ones are."""
    torch.manual_seed(seed)
    config = transformers.Gemma3Config(text_config=text_config, vision_config=VISION,
                                       **TOP_LEVEL)
    config.text_config.initializer_range = 0.2
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "language_model" in name and "norm" in name:
                parameter.normal_(1.0, 0.5)
    model.save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    values = json.loads((directory / "config.json").read_text())
    values["eos_token_id"] = [1, 3]     # <eos> and Gemma's <end_of_turn> (here <unk>)
    (directory / "config.json").write_text(json.dumps(values))
    model.config.vocab_size = model.config.text_config.vocab_size    # for the helpers
    return model


@pytest.fixture(scope="module")
def imported(gemma_tokenizer, tmp_path_factory):  # noqa: F811 (the fixture imported)
    """(HF model, our model, checkpoint path, HF directory)."""
    root = tmp_path_factory.mktemp("multimodal")
    vocab = json.loads((gemma_tokenizer / "tokenizer.json").read_text())["model"]["vocab"]
    hf = multimodal_checkpoint(root / "hf", gemma_tokenizer,
                               dict(TEXT, vocab_size=len(vocab)))
    out = import_gemma(root / "hf", root / "ours")
    return hf, load_model(out), out, root / "hf"


def test_the_language_model_computes_transformers_text_logits(imported):
    hf, ours, _, directory = imported
    c = ours.config
    assert (c.num_decoder_layers, c.full_attention_layers, c.attention_window) == (6, (5,), 5)
    assert (c.rope_base, c.local_rope_base, c.rope_scaling) == (1e6, 1e4, "linear")
    assert any(key.startswith("vision_tower.") for key in load_file(directory /
                                                                     "model.safetensors"))
    assert_same_logits(hf, ours, atol=ATOL)


def test_greedy_generation_matches_transformers(imported, monkeypatch):
    hf, ours, _, _ = imported
    assert_same_greedy_tokens(hf, ours, 30, monkeypatch)


def test_the_query_scale_is_folded_into_the_queries_norm(imported):
    """Scores over sqrt(query_pre_attn_scalar) = 12: each q_norm gain is (1 + w) times
    sqrt(8 / 12); without that factor the logits differ."""
    hf, ours, _, _ = imported
    theirs = hf.model.language_model.layers[0].self_attn.q_norm.weight
    ours_norm = ours.decoder.layers[0].self_attn.q_norm
    torch.testing.assert_close(ours_norm.weight, (1 + theirs) * (8 / 12) ** 0.5)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 12))
    with torch.no_grad():
        expected = hf(tokens).logits
        for layer in ours.decoder.layers:
            layer.self_attn.q_norm.weight /= (8 / 12) ** 0.5
        assert not torch.allclose(ours(tokens), expected, atol=1e-3)
        for layer in ours.decoder.layers:
            layer.self_attn.q_norm.weight *= (8 / 12) ** 0.5
        torch.testing.assert_close(ours(tokens), expected, atol=ATOL, rtol=1e-5)


def test_the_end_tokens_come_from_the_top_level_config(imported):
    _, _, out, _ = imported
    assert Generator.load(out).end_ids == (1, 3)


def test_transformers_4_52_layout_imports_as_the_same_model(imported, tmp_path):
    """Names under model.language_model. and model.vision_tower. (transformers 4.52 to
    4.57's saves), with the output matrix stored: the same weights."""
    _, ours, _, directory = imported

    def renamed(tensors):
        moved = {key.replace("language_model.model.", "model.language_model.")
                    .replace("vision_tower.", "model.vision_tower.")
                    .replace("multi_modal_projector.", "model.multi_modal_projector."): value
                 for key, value in tensors.items()}
        moved["lm_head.weight"] = moved["model.language_model.embed_tokens.weight"].clone()
        return moved
    again = load_model(import_gemma(damaged(directory, tmp_path, weights=renamed),
                                    tmp_path / "out"))
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], value, atol=0, rtol=0)


def test_a_published_style_text_config_reads_gemma3_text_defaults(gemma_tokenizer,  # noqa: F811
                                                                  tmp_path):
    """A text_config naming only sizes, the rotary scaling and the window (as
    gemma-3-4b-it's does): what it leaves out is Gemma3TextConfig's default, as
    transformers reads it."""
    directory = tmp_path / "hf"
    multimodal_checkpoint(directory, gemma_tokenizer, PUBLISHED_TEXT, seed=3)
    values = json.loads((directory / "config.json").read_text())
    values["text_config"] = PUBLISHED_TEXT          # what save_pretrained filled in, gone
    (directory / "config.json").write_text(json.dumps(values))
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(directory).eval()
    hf.config.vocab_size = hf.config.text_config.vocab_size
    ours = load_model(import_gemma(directory, tmp_path / "ours"))
    c = ours.config
    assert (c.tgt_vocab_size, c.num_heads, c.num_kv_heads, c.head_size) == (262208, 8, 4, 256)
    assert (c.full_attention_layers, c.attention_window, c.local_rope_base) == ((5,), 7, 1e4)
    # Logits up to 13 here: each side's float32 logits are up to 8.5e-5 from its float64
    # ones (one thread, AVX-512), so the two may differ by twice that.
    assert_same_logits(hf, ours, atol=2 * ATOL)


def test_the_processor_chat_template_is_read(imported, tmp_path):
    """chat_template.json (a multimodal model's processor file) gives the template where
    tokenizer_config.json names none."""
    _, _, _, directory = imported
    template = "{% for m in messages %}<start>{{ m['content'] }}<end>{% endfor %}<start>"
    copy = damaged(directory, tmp_path)
    (copy / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = Generator.load(import_gemma(copy, tmp_path / "out")).tokenizer
    assert tokenizer.chat_template.render(Chat.of([{"role": "user", "content": "hi"}])) == \
        "<start>hi<end><start>"


@pytest.mark.parametrize("change,message", [
    (lambda c: c.pop("text_config") and None, "needs a text_config object"),
    (lambda c: c["text_config"].update(query_pre_attn_scalar=-1.0),
     "config.json text_config: query_pre_attn_scalar=-1.0: must be a positive number"),
    (lambda c: c["text_config"].update(final_logit_softcapping=30.0),
     "config.json text_config: final_logit_softcapping=30.0 is not supported"),
    (lambda c: c["text_config"].update(eos_token_id=7),
     "eos_token_id=7 but the tokenizer's eos token '<eos>' is 1"),
])
def test_refuses_what_it_cannot_read(imported, tmp_path, change, message):
    _, _, _, directory = imported
    assert_refused(import_gemma, damaged(directory, tmp_path, config=change), tmp_path,
                   message)


def test_an_unknown_weight_outside_the_vision_tower_is_refused(imported, tmp_path):
    _, _, _, directory = imported

    def add(tensors):
        tensors["language_model.model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    assert_refused(import_gemma, damaged(directory, tmp_path, weights=add), tmp_path,
                   "unknown weight 'language_model.model.layers.0.self_attn.q_proj.bias'")

    def both(tensors):
        norm = tensors["language_model.model.norm.weight"]
        tensors["model.language_model.norm.weight"] = norm.clone()
    assert_refused(import_gemma, damaged(directory, tmp_path / "b", weights=both),
                   tmp_path / "b", "the same weight stored twice")


def test_command_line_says_the_vision_tower_is_left_out(imported, tmp_path, capsys):
    _, _, _, directory = imported
    assert main(["import", "hf-gemma", str(directory), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "6 layers, d_model 32" in printed and "vision tower" in printed


def test_the_top_level_special_ids_count_where_text_config_names_none(tmp_path):
    """gemma-3-4b-it's config.json lists its end tokens (<eos>, <end_of_turn>) at the top
    level only; text_config's own values win where it names them."""
    from transduce.importers.hf_gemma import text_config

    stored = {"model_type": "gemma3", "eos_token_id": [1, 106], "tie_word_embeddings": False,
              "text_config": {"model_type": "gemma3_text", "bos_token_id": 5}}
    hf, where = text_config(stored, tmp_path / "config.json")
    assert (hf["eos_token_id"], hf["bos_token_id"], hf["tie_word_embeddings"]) == \
        ([1, 106], 5, False)
    assert (hf["vocab_size"], hf["query_pre_attn_scalar"]) == (262208, 256)
    assert where == f"{tmp_path / 'config.json'} text_config"
    unnamed, _ = text_config({"model_type": "gemma3", "text_config": {}}, tmp_path / "c.json")
    assert unnamed["model_type"] == "gemma3_text"
