"""The ONNX export run by ONNX Runtime computes what our model computes, at sizes other
than the export's example (empty and one-token pasts included), and the same searches
give the same tokens on both engines."""

import pytest
import torch

from tests.test_export import saved_model, sources
from transduce import checkpoint
from transduce.cli import main
from transduce.config import ConfigError, preset
from transduce.data.tokenizer import BOS_ID, EOS_ID, MODEL_NAME
from transduce.decode.search import beam_search, greedy_search
from transduce.decode.translate import Translator
from transduce.export import ExportError
from transduce.model import Transformer

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from transduce.decode.onnx_engine import OnnxEngine  # noqa: E402
from transduce.export.onnx import export_onnx  # noqa: E402

VARIANTS = [
    {},                                                            # MHA, sinusoidal, post-norm
    {"num_kv_heads": 2, "norm_first": True},                       # GQA, pre-norm
    {"num_kv_heads": 1, "positional": "rotary"},                   # MQA, rotary
    {"positional": "learned", "norm_first": True, "activation": "gelu"},
    {"norm": "rms", "gated_ffn": True, "activation": "silu", "bias": False,   # Llama's layers
     "norm_first": True, "positional": "rotary", "num_kv_heads": 2},
    {"qk_norm": True, "num_kv_heads": 2, "norm_first": True},   # normalized q, k (cross too)
]


def exported(tmp_path, tiny_corpus, **changes):
    model, path = saved_model(tmp_path, tiny_corpus, **changes)
    return model, OnnxEngine(export_onnx(path, tmp_path / "onnx"))


def step_logits(engine, src, steps, beams):
    """Prefill, `beams` rows per source, then the given (R, t) token blocks in turn ->
    the logits of every step."""
    state = engine.prefill(src, 64)
    state.reorder(torch.arange(src.shape[0]).repeat_interleave(beams))
    return [engine.decode_step(tokens, state) for tokens in steps], state


@pytest.mark.parametrize("changes", VARIANTS, ids=lambda c: ",".join(c) or "base")
def test_logits_match_at_other_sizes_and_past_lengths(tmp_path, tiny_corpus, changes):
    model, engine = exported(tmp_path, tiny_corpus, **changes)
    for batch, beams in [(1, 1), (4, 1), (3, 3)]:
        src = sources()[:batch]
        rows = batch * beams
        # past lengths 0 (first step), 1, 2 (a 3-token step), then 5 and 6
        steps = [torch.full((rows, 1), BOS_ID), torch.randint(4, 300, (rows, 1)),
                 torch.randint(4, 300, (rows, 3)), torch.randint(4, 300, (rows, 1))]
        with torch.no_grad():
            want, _ = step_logits(model, src, steps, beams)
        got, state = step_logits(engine, src, steps, beams)
        assert state.length == 6
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=0, atol=1e-4)


def test_reorder_and_dropped_sources_follow_pytorch(tmp_path, tiny_corpus):
    model, engine = exported(tmp_path, tiny_corpus, num_kv_heads=2)
    src = sources()
    results = []
    for runner in (model, engine):
        state = runner.prefill(src, 32)
        state.reorder(torch.arange(4).repeat_interleave(2))
        with torch.no_grad():
            runner.decode_step(torch.randint(4, 300, (8, 1), generator=torch.Generator().manual_seed(1)),
                               state)
            # beams swap within sentences, then sentences 0 and 2 leave
            state.reorder(torch.tensor([1, 0, 3, 3, 4, 5, 7, 6]))
            state.reorder(torch.tensor([2, 3, 6, 7]), torch.tensor([1, 3]))
            results.append(runner.decode_step(torch.full((4, 1), 9), state))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("changes", VARIANTS[:3], ids=lambda c: ",".join(c) or "base")
def test_greedy_and_beam_search_give_the_same_tokens(tmp_path, tiny_corpus, changes):
    model, engine = exported(tmp_path, tiny_corpus, **changes)
    src = sources()
    options = {"bos_id": BOS_ID, "eos_id": EOS_ID, "max_len": 15}
    assert torch.equal(greedy_search(engine, src, **options), greedy_search(model, src, **options))
    ours = beam_search(model, src, beam=4, nbest=4, **options)
    theirs = beam_search(engine, src, beam=4, nbest=4, **options)
    assert [[h.tokens for h in hyps] for hyps in theirs] == [[h.tokens for h in hyps] for hyps in ours]
    for hyps_o, hyps_t in zip(ours, theirs):
        assert [h.score for h in hyps_t] == pytest.approx([h.score for h in hyps_o], abs=1e-4)


def test_translator_and_cli_run_the_export(tmp_path, tiny_corpus, capsys):
    _, path = saved_model(tmp_path, tiny_corpus, norm_first=True)
    out = tmp_path / "onnx"
    assert main(["export", "onnx", str(path), str(out)]) == 0
    lines = ["el perro come", "", "uno dos tres casa"]
    torch_lines = Translator.load(path).translate(lines, beam=2)
    onnx = Translator.load(out)                       # auto: ONNX Runtime for an export
    assert isinstance(onnx.model, OnnxEngine)
    assert onnx.translate(lines, beam=2) == torch_lines
    (tmp_path / "in.es").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["translate", "--model", str(out), "--engine", "onnxruntime", "--beam", "2",
                 "--input", str(tmp_path / "in.es"), "--output", str(tmp_path / "out.en")]) == 0
    assert (tmp_path / "out.en").read_text(encoding="utf-8").splitlines() == torch_lines


def test_int8_export_stays_close(tmp_path, tiny_corpus):
    model, path = saved_model(tmp_path, tiny_corpus)
    engine = OnnxEngine(export_onnx(path, tmp_path / "int8", quantize="int8"))
    src = sources()
    with torch.no_grad():
        want, _ = step_logits(model, src, [torch.full((4, 1), BOS_ID)], 1)
    got, _ = step_logits(engine, src, [torch.full((4, 1), BOS_ID)], 1)
    error = (got[0] - want[0]).abs().max().item()
    assert 0 < error < 0.1 * want[0].abs().max().item()     # quantized, and close


def test_what_onnx_cannot_run_is_refused_clearly(tmp_path, tiny_corpus, capsys):
    _, path = saved_model(tmp_path, tiny_corpus, attention_type="linear")
    with pytest.raises(ExportError, match="attention_type='linear'"):
        export_onnx(path, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()
    assert main(["export", "onnx", str(path), str(tmp_path / "onnx")]) == 1
    assert "cannot export to ONNX: attention_type='linear'" in capsys.readouterr().err
    _, plain = saved_model(tmp_path / "plain", tiny_corpus)
    with pytest.raises(ConfigError, match="needs an ONNX export"):
        Translator.load(plain, engine="onnxruntime")
    out = export_onnx(plain, tmp_path / "good")
    for dtype in ("bfloat16", "int8"):
        with pytest.raises(ConfigError, match="--dtype"):
            Translator.load(out, dtype=dtype)
    with pytest.raises(ConfigError, match="kv_dtype"):
        greedy_search(OnnxEngine(out), sources(), bos_id=BOS_ID, eos_id=EOS_ID,
                      cache_dtype=torch.int8)
    assert main(["translate", "--model", str(out), "--engine", "torch"]) == 2
    assert "ONNX export" in capsys.readouterr().err
    (out / "decoder_step.onnx").write_bytes(b"not a graph")
    assert main(["translate", "--model", str(out)]) == 1
    assert "decoder_step.onnx: not loadable by ONNX Runtime" in capsys.readouterr().err


def test_an_export_keeps_the_language_pair_its_checkpoint_records(tmp_path, tiny_corpus):
    """A server of the export offers LibreTranslate's clients the pair the model learned."""
    model = Transformer(preset("tiny", src_vocab_size=300, tgt_vocab_size=300)).eval()
    model.languages = ("de", "fr")
    path = checkpoint.save(tmp_path / "ckpt", model, None, tiny_corpus / MODEL_NAME)
    assert main(["export", "onnx", str(path), str(tmp_path / "onnx")]) == 0
    assert Translator.load(tmp_path / "onnx").model.languages == ("de", "fr")


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_graphs_over_the_inline_limit_keep_their_weights_in_one_file_each(
        tmp_path, tiny_corpus, monkeypatch, quantize):
    """Past protobuf's 2 GB (NLLB-600M's decoder step: 2.6 GB), a graph's weights go to
    GRAPH.data, one file, not one per weight as the tracer writes them; here the limit
    is lowered to 1 KB so that a tiny model takes that path, and runs as inline."""
    from transduce.export import onnx_files

    _, path = saved_model(tmp_path, tiny_corpus, norm_first=True)
    inline = export_onnx(path, tmp_path / "inline", quantize)
    monkeypatch.setattr(onnx_files, "INLINE_BYTES", 1024)
    apart = export_onnx(path, tmp_path / "apart", quantize)
    assert sorted([*(p.name for p in inline.iterdir()), "decoder_step.onnx.data",
                   "encoder.onnx.data"]) == sorted(p.name for p in apart.iterdir())
    size = {name: (inline / name).stat().st_size for name in ("decoder_step.onnx", "encoder.onnx")}
    assert all((apart / name).stat().st_size < held for name, held in size.items())
    lines = ["el perro come", "uno dos tres casa"]
    assert Translator.load(apart).translate(lines, beam=2) == \
        Translator.load(inline).translate(lines, beam=2)


def test_weights_the_tracer_wrote_apart_are_gathered_into_one_file(tmp_path):
    """torch.onnx.export's layout over 2 GB (a file per weight, named after it) is
    rewritten as GRAPH.data, the files it wrote removed, the graph computing the same."""
    import numpy as np
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from transduce.export import onnx_files

    weights = [numpy_helper.from_array(np.full((64, 64), i + 1.0, np.float32), f"w{i}")
               for i in range(3)]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", f"w{i}"],
                              [f"h{i + 1}" if i < 2 else "y"]) for i in range(3)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 64])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, 64])], weights)
    traced = tmp_path / "traced" / "step.onnx"
    traced.parent.mkdir()
    onnx.save_model(helper.make_model(graph), str(traced), save_as_external_data=True,
                    all_tensors_to_one_file=False, size_threshold=0)
    assert len(list(traced.parent.iterdir())) == 4
    x = np.ones((1, 64), np.float32)
    want = onnxruntime.InferenceSession(str(traced)).run(None, {"x": x})[0]
    original = onnx_files.INLINE_BYTES
    try:
        onnx_files.INLINE_BYTES = 1024
        onnx_files.rewrite_graph(traced, tmp_path / "step.onnx")
    finally:
        onnx_files.INLINE_BYTES = original
    assert not traced.parent.exists() or not list(traced.parent.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["step.onnx",
                                                                         "step.onnx.data"]
    got = onnxruntime.InferenceSession(str(tmp_path / "step.onnx")).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


def _stored(graph):
    """name -> (shape, where its bytes are: None inside the graph, else the file)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    return {t.name: (tuple(t.dims), next((e.value for e in t.external_data
                                          if e.key == "location"), None))
            for t in model.graph.initializer}


def _ops_on(graph, weight):
    """The operators of the graph that read `weight`."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    return sorted(n.op_type for n in model.graph.node if weight in n.input)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_tied_embedding_is_stored_once_in_each_graph(tmp_path, tiny_corpus, quantize):
    """The tracer writes the tied matrix (V, C) for the embeddings and (C, V) for the
    output MatMul: the output is a Gemm by the (V, C) table, and no (C, V) copy is kept
    (int8: one int8 (C, V) matrix, the embedding gathering its columns)."""
    model, path = saved_model(tmp_path, tiny_corpus)
    out = export_onnx(path, tmp_path / "onnx", quantize)
    stored = {name: shape for name, (shape, _) in _stored(out / "decoder_step.onnx").items()}
    if quantize is None:
        assert list(stored.values()).count((300, 64)) == 1 and (64, 300) not in stored.values()
        table = next(name for name, shape in stored.items() if shape == (300, 64))
        assert _ops_on(out / "decoder_step.onnx", table) == ["Gather", "Gemm"]
        engine, src = OnnxEngine(out), sources()
        steps = [torch.full((8, 1), BOS_ID), torch.randint(4, 300, (8, 3))]
        with torch.no_grad():
            want, _ = step_logits(model, src, steps, 2)
        got, _ = step_logits(engine, src, steps, 2)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
        assert [shape for shape, _ in _stored(out / "encoder.onnx").values()].count(
            (300, 64)) == 1
    else:
        assert list(stored.values()).count((64, 300)) == 1 and (300, 64) not in stored.values()
        columns = next(name for name, shape in stored.items() if shape == (64, 300))
        assert _ops_on(out / "decoder_step.onnx", columns) == ["Gather", "MatMulInteger"]
        encoder = [shape for shape, _ in _stored(out / "encoder.onnx").values()]
        assert encoder.count((64, 300)) == 1 and (300, 64) not in encoder


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_tied_matrix_under_the_inline_limit_is_stored_once_for_both_graphs(
        tmp_path, tiny_corpus, monkeypatch, quantize):
    """Inside the inline limit, a table of SHARED_BYTES or more that both graphs hold
    (lowered to 1 KB here, as for the 8 MB table of a model of 8,000 ids) moves the
    decoder step's weights to decoder_step.onnx.data, which the encoder reads it from;
    the export translates as the one that stores it twice."""
    from transduce.export import onnx_files

    _, path = saved_model(tmp_path, tiny_corpus, norm_first=True)
    twice = export_onnx(path, tmp_path / "twice", quantize)
    monkeypatch.setattr(onnx_files, "SHARED_BYTES", 1024)
    once = export_onnx(path, tmp_path / "once", quantize)
    assert not (twice / "decoder_step.onnx.data").exists()
    where = {shape: file for shape, file in _stored(once / "encoder.onnx").values()}
    table, size = ((300, 64), 300 * 64 * 4) if quantize is None else ((64, 300), 300 * 64)
    assert where[table] == "decoder_step.onnx.data" and \
        not (once / "encoder.onnx.data").exists()
    sizes = [(d / "encoder.onnx").stat().st_size for d in (twice, once)]
    assert sizes[0] - sizes[1] > 0.99 * size        # less the entry naming where it is
    lines = ["el perro come", "uno dos tres casa"]
    assert Translator.load(once).translate(lines, beam=2) == \
        Translator.load(twice).translate(lines, beam=2)


def test_an_untied_output_is_multiplied_as_traced(tmp_path, tiny_corpus):
    _, path = saved_model(tmp_path, tiny_corpus, tie_embeddings="none")
    out = export_onnx(path, tmp_path / "onnx")
    stored = [shape for shape, _ in _stored(out / "decoder_step.onnx").values()]
    assert stored.count((300, 64)) == 1 and stored.count((64, 300)) == 1


def test_the_encoder_reads_the_tied_matrix_from_the_decoder_steps_file(
        tmp_path, tiny_corpus, monkeypatch):
    """Past the inline limit (lowered to 1 KB here, as for NLLB's 1 GB matrix), the
    encoder's graph points at the bytes decoder_step.onnx.data holds, and its own file
    is that much smaller; it translates as the inline export."""
    from transduce.export import onnx_files

    _, path = saved_model(tmp_path, tiny_corpus, norm_first=True)
    inline = export_onnx(path, tmp_path / "inline")
    monkeypatch.setattr(onnx_files, "INLINE_BYTES", 1024)
    monkeypatch.setattr(onnx_files, "SHARED_BYTES", 1024)
    apart = export_onnx(path, tmp_path / "apart")
    where = {shape: file for shape, file in _stored(apart / "encoder.onnx").values()}
    assert where[(300, 64)] == "decoder_step.onnx.data"
    assert all(file == "encoder.onnx.data" for shape, file in where.items()
               if shape != (300, 64) and file is not None)
    monkeypatch.setattr(onnx_files, "SHARED_BYTES", 1 << 40)       # nothing shared
    unshared = export_onnx(path, tmp_path / "unshared")
    sizes = [(d / "encoder.onnx.data").stat().st_size for d in (unshared, apart)]
    assert sizes[0] - sizes[1] >= 300 * 64 * 4
    lines = ["el perro come", "uno dos tres casa"]
    assert Translator.load(apart).translate(lines, beam=2) == \
        Translator.load(inline).translate(lines, beam=2)
