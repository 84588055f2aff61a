"""A decoder-only model's ONNX export (one graph for prompt and steps) run by ONNX Runtime
computes what our model computes, for left-padded batches and at every past length,
generates the same text through the same searches, scores tokens as it does, computes
what transformers computes for an imported Llama, and is served like the checkpoint;
what it cannot hold is refused by name."""

import dataclasses
import json

import pytest
import torch
from fastapi.testclient import TestClient

from tests.foreign_checkpoints import assert_same_logits, left_padded
from tests.test_export_decoder import VOCAB, saved_language_model
from tests.test_import_llama import CONFIGS, hf_checkpoint, write_spm_bpe
from transduce import load
from transduce.cli import main
from transduce.config import ConfigError
from transduce.data.corpus import write_text_metadata
from transduce.decode.generate import Generator
from transduce.decode.options import GenerateOptions
from transduce.decode.search import beam_search, greedy_search
from transduce.export import ExportError
from transduce.importers import import_llama
from transduce.onnx_format import OnnxExportError
from transduce.serve import create_app

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from transduce.decode.onnx_lm_engine import OnnxLanguageModel  # noqa: E402
from transduce.export.onnx import export_onnx  # noqa: E402

VARIANTS = {  # preset, changes
    "llama-gqa": ("llama-tiny", {"tie_embeddings": "none"}),
    "llama-mqa-scaled": ("llama-tiny", {"num_kv_heads": 1, "rope_scaling": "llama3",
                                        "rope_factor": 8.0, "rope_original_positions": 16}),
    "gpt": ("gpt-tiny", {}),
    "gpt-sinusoidal-post-norm": ("gpt-tiny", {"positional": "sinusoidal", "norm_first": False}),
    "mistral-sliding": ("llama-tiny", {"attention_type": "sliding", "attention_window": 3}),
    "qwen3-qk-norm": ("llama-tiny", {"qk_norm": True, "head_size": 8}),
    "gemma3-local-and-full": ("llama-tiny", {"attention_type": "sliding",
                                             "attention_window": 3, "num_decoder_layers": 3,
                                             "full_attention_layers": (1,),
                                             "local_rope_base": 100.0, "sandwich_norm": True,
                                             "qk_norm": True, "scale_embeddings": True}),
    # BLOOM's: ALiBi's slopes (6 heads), a norm of the embeddings
    "bloom-alibi": ("gpt-tiny", {"positional": "alibi", "embedding_norm": True,
                                 "num_heads": 6, "d_model": 48}),
}
PROMPTS = ["uno dos tres casa el perro", "el gato", "", "dos"]


def exported(tmp_path, tiny_corpus, variant, quantize=None):
    name, changes = VARIANTS[variant]
    model, path = saved_language_model(tmp_path, tiny_corpus, name, **changes)
    out = export_onnx(path, tmp_path / "onnx", quantize)
    return model, path, OnnxLanguageModel(out)


def _assert_stored_once_if_tied(graph, model):
    """A tied embedding is kept as its (V, C) table only, the output a Gemm by it
    (export/onnx_tied.py); an untied one as traced."""
    import onnx

    stored = [tuple(t.dims) for t in onnx.load(str(graph)).graph.initializer]
    rows, columns = (VOCAB, model.config.d_model), (model.config.d_model, VOCAB)
    tied = model.config.tie_embeddings != "none"
    assert (stored.count(rows), stored.count(columns)) == ((1, 0) if tied else (1, 1))


def stepped_logits(runner, prompt, mask, steps):
    """Prefill, then the given (B, t) token blocks in turn -> the logits of every block."""
    state = runner.prefill(prompt, 32, src_mask=mask[:, None, None, :])
    return [runner.decode_step(tokens, state) for tokens in steps], state


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_at_every_past_length_with_left_padding(tmp_path, tiny_corpus, variant):
    model, _, engine = exported(tmp_path, tiny_corpus, variant)
    _assert_stored_once_if_tied(tmp_path / "onnx" / "decoder.onnx", model)
    for lengths in ([1], [9, 4, 1], [2, 2]):
        prompt, mask = left_padded(lengths, max(lengths), VOCAB, model.config.pad_id)
        # the last prompt token, then one token, three, one: past lengths P - 1 .. P + 4
        steps = [prompt[:, -1:], torch.randint(4, VOCAB, (len(lengths), 1)),
                 torch.randint(4, VOCAB, (len(lengths), 3)),
                 torch.randint(4, VOCAB, (len(lengths), 1))]
        with torch.no_grad():
            want, _ = stepped_logits(model, prompt, mask, steps)
            whole = model(torch.cat([prompt, *steps[1:]], dim=1),
                          key_mask=torch.cat([mask, torch.ones(len(lengths), 5, dtype=torch.bool)],
                                             dim=1))
        got, state = stepped_logits(engine, prompt, mask, steps)
        assert state.length == max(lengths) + 5
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
        # the steps' logits are the whole sequence's at the same positions
        torch.testing.assert_close(torch.cat(got, dim=1), whole[:, max(lengths) - 1:],
                                   rtol=0, atol=1e-4)


def test_reordered_rows_follow_pytorch(tmp_path, tiny_corpus):
    model, _, engine = exported(tmp_path, tiny_corpus, "llama-gqa")
    prompt, mask = left_padded([5, 2, 4], 5, VOCAB, model.config.pad_id)
    results = []
    for runner in (model, engine):
        state = runner.prefill(prompt, 16, src_mask=mask[:, None, None, :])
        with torch.no_grad():
            runner.decode_step(prompt[:, -1:], state)
            state.reorder(torch.tensor([2, 0, 0, 1]))       # reordered, row 0 twice (beams)
            results.append(runner.decode_step(torch.full((4, 1), 9), state))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("variant", ["llama-gqa", "gpt", "mistral-sliding",
                                     "gemma3-local-and-full"])
def test_generation_and_searches_give_the_same_text(tmp_path, tiny_corpus, variant):
    _, path, _ = exported(tmp_path, tiny_corpus, variant)
    ours, theirs = Generator.load(path), Generator.load(tmp_path / "onnx")
    assert isinstance(theirs.model, OnnxLanguageModel)
    for settings in ({}, {"beam": 3}, {"temperature": 0.9, "top_k": 20, "seed": 3},
                     {"repetition_penalty": 1.3, "stop": ("e",)}, {"prompt_lookup": 3}):
        options = GenerateOptions(max_new_tokens=12, batch_sentences=3, **settings)
        greedy = dataclasses.replace(options, prompt_lookup=0)   # a window's: ours refuses
        assert theirs.generate(PROMPTS, options) == ours.generate(PROMPTS, greedy)
    sampled = GenerateOptions(max_new_tokens=12, temperature=0.9, top_k=20, seed=3,
                              prompt_lookup=3)                  # speculative sampling
    if ours.model.config.attention_type != "sliding":
        assert theirs.generate(PROMPTS, sampled) == ours.generate(PROMPTS, sampled)
    assert "".join(theirs.stream(PROMPTS[0], max_new_tokens=12)) == \
        ours.generate(PROMPTS[:1], max_new_tokens=12)[0]
    prompt, mask = left_padded([6, 3], 6, VOCAB, 0)
    search = {"bos_id": prompt[:, -1], "eos_id": -1, "max_len": 10,
              "src_mask": mask[:, None, None, :]}
    assert torch.equal(greedy_search(theirs.model, prompt, **search),
                       greedy_search(ours.model, prompt, **search))
    found = [beam_search(runner.model, prompt, beam=3, nbest=3, **search)
             for runner in (ours, theirs)]
    assert [[h.tokens for h in row] for row in found[1]] == \
        [[h.tokens for h in row] for row in found[0]]
    sequences = [ids + [5, 9, 11, 7] for ids in ours.encode(PROMPTS)]    # /v1/completions'
    for mine, its in zip(ours.token_logprobs(sequences, 3), theirs.token_logprobs(sequences, 3)):
        assert its.logprobs == pytest.approx(mine.logprobs, abs=1e-4)
        assert [[i for i, _ in best] for best in its.top] == \
            [[i for i, _ in best] for best in mine.top]


def test_the_cli_and_a_server_run_the_export(tmp_path, tiny_corpus, capsys):
    _, path, _ = exported(tmp_path, tiny_corpus, "gpt")
    out = tmp_path / "cli"
    assert main(["export", "onnx", str(path), str(out)]) == 0
    assert "run it with `transduce generate --model" in capsys.readouterr().out
    expected = Generator.load(path).generate(PROMPTS[:2], max_new_tokens=8)
    for engine in ("auto", "onnxruntime"):
        assert main(["generate", "--model", str(out), "--engine", engine, "--max-new-tokens",
                     "8", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]) == 0
        assert capsys.readouterr().out.splitlines() == expected
    generator = load(out)
    assert isinstance(generator, Generator) and isinstance(generator.model, OnnxLanguageModel)
    with TestClient(create_app(generator)) as client:
        answer = client.post("/v1/generate", json={"prompts": PROMPTS[:2], "max_new_tokens": 8})
        assert answer.status_code == 200
        assert answer.json()["generations"] == expected
        described = client.get("/v1/models").json()["data"][0]
        assert described["kind"] == "generation"
        assert described["parameters"] == Generator.load(path).model.num_parameters()
        assert described["attention_maps"] is False            # the graph returns logits
        assert client.post("/v1/attention", json={"prompt": "a"}).status_code == 404


@pytest.mark.parametrize("config", [0, 4, 5, 6, 7],
                         ids=["llama-gqa", "mistral-sliding", "qwen2", "head-dim", "qwen3"])
def test_an_imported_llama_export_computes_what_transformers_computes(tmp_path, config):
    (tmp_path / "tokenizer").mkdir()
    hf = hf_checkpoint(tmp_path / "hf", write_spm_bpe(tmp_path / "tokenizer"),
                       **dict(CONFIGS[config]))
    imported = import_llama(tmp_path / "hf", tmp_path / "ours")
    out = export_onnx(imported, tmp_path / "onnx")
    assert (out / "tokenizer.json").is_file()          # the checkpoint's own tokenizer
    engine = OnnxLanguageModel(out)

    class WholePass(torch.nn.Module):
        """The export's pass over whole sequences, as the model's forward."""
        config = engine.config

        def forward(self, tokens, key_mask=None):
            return engine.logits(tokens, key_mask)

    assert_same_logits(hf, WholePass(), atol=1e-4)
    text = ["In the beginning God", "El niño"]
    assert Generator.load(out).generate(text, max_new_tokens=10) == \
        Generator.load(imported).generate(text, max_new_tokens=10)


def test_perplexity_of_the_export_is_the_checkpoint_s(tmp_path, tiny_corpus, capsys):
    _, path, _ = exported(tmp_path, tiny_corpus, "llama-gqa")
    corpus = tmp_path / "text"
    corpus.mkdir()
    lines = (tiny_corpus / "test.es").read_text(encoding="utf-8").splitlines()
    (corpus / "test.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    write_text_metadata(corpus, "es")
    results = []
    for model, batch_tokens in ((path, "4096"), (tmp_path / "onnx", "4096"),
                                (tmp_path / "onnx", "40")):
        out = tmp_path / f"eval-{len(results)}"
        assert main(["evaluate", "--model", str(model), "--data", str(corpus),
                     "--batch-tokens", batch_tokens, "--out", str(out)]) == 0
        results.append(json.loads(out.with_suffix(".json").read_text()))
    assert "perplexity" in capsys.readouterr().out
    for result in results[1:]:
        assert result["pieces"] == results[0]["pieces"] > 100
        assert result["nll"] == pytest.approx(results[0]["nll"], rel=1e-5)
    assert main(["evaluate", "--model", str(tmp_path / "onnx"), "--data", str(corpus),
                 "--engine", "torch"]) == 2
    assert "only ONNX Runtime runs" in capsys.readouterr().err


def test_int8_export_stays_close(tmp_path, tiny_corpus):
    model, _, engine = exported(tmp_path, tiny_corpus, "llama-gqa", quantize="int8")
    prompt, mask = left_padded([7, 3], 7, VOCAB, model.config.pad_id)
    with torch.no_grad():
        want, _ = stepped_logits(model, prompt, mask, [prompt[:, -1:]])
    got, _ = stepped_logits(engine, prompt, mask, [prompt[:, -1:]])
    error = (got[0] - want[0]).abs().max().item()
    assert 0 < error < 0.1 * want[0].abs().max().item()     # quantized, and close


@pytest.mark.parametrize("name, changes, message", [
    ("gpt-tiny", {"attention_type": "linear"}, "attention_type='linear'"),
    ("gpt-tiny", {"positional": "t5"}, "positional='t5'"),       # (ALiBi it holds)
    ("tiny", {"arch": "rnn-luong"}, "arch='rnn-luong' (the export holds the Transformer's"),
    ("bert-tiny", {"attention_type": "linear"}, "attention_type='linear'"),
])
def test_what_the_export_cannot_hold_is_refused_by_name(tmp_path, tiny_corpus, capsys, name,
                                                        changes, message):
    _, path = saved_language_model(tmp_path, tiny_corpus, name, **changes)
    with pytest.raises(ExportError, match=message.replace("(", r"\(")):
        export_onnx(path, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()
    assert main(["export", "onnx", str(path), str(tmp_path / "onnx")]) == 1
    assert message in capsys.readouterr().err


def test_wrong_uses_of_the_export_are_refused_clearly(tmp_path, tiny_corpus, capsys):
    _, path, _ = exported(tmp_path, tiny_corpus, "gpt")
    out = tmp_path / "onnx"
    with pytest.raises(ConfigError, match="--dtype"):
        Generator.load(out, dtype="bfloat16")
    with pytest.raises(ConfigError, match="needs an ONNX export"):
        Generator.load(path, engine="onnxruntime")
    assert main(["generate", "--model", str(out), "--engine", "torch", "--prompt", "a"]) == 2
    assert "only ONNX Runtime runs" in capsys.readouterr().err
    assert main(["translate", "--model", str(out)]) == 2
    assert "translation needs an encoder-decoder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="left-padded"):
        OnnxLanguageModel(out).prefill(torch.tensor([[5, 6]]), 4,
                                       src_mask=torch.tensor([[True, False]])[:, None, None])
    info = json.loads((out / "onnx.json").read_text())
    (out / "onnx.json").write_text(json.dumps({**info, "graphs": ["model.onnx"]}))
    with pytest.raises(OnnxExportError, match='"graphs" must list'):
        load(out)
    (out / "onnx.json").write_text(json.dumps(info))
    (out / "decoder.onnx").unlink()
    assert main(["generate", "--model", str(out), "--prompt", "a"]) == 1
    assert "decoder.onnx is missing" in capsys.readouterr().err
