"""The written-out decoder step (model/decoder_step.py) against the modules' own step:
the same logits to the bit, step after step, for every layout it covers; the others are
left to the modules."""

import copy
import threading

import pytest
import torch

from transduce.attention import one_query
from transduce.attention.kv_cache import QuantizedKVCache
from transduce.config import preset
from transduce.model import Transformer, build_model
from transduce.model import int8 as int8_module
from transduce.model import packed as packed_module
from transduce.model.decoder_step import MAX_STEP_TOKENS, DecoderStep
from transduce.model.packed import decoding_copy, packing_available
from tests.model.test_transformer import padded, tiny

VOCAB = 20


def copy_for_decoding(model, packed: bool, int8: bool, monkeypatch):
    """A decoding copy, packed or not, with every product in int8 or none."""
    if packed and not packing_available(torch.float32):
        pytest.skip("no oneDNN in this build")
    if int8 and not int8_module.int8_available():
        pytest.skip("no oneDNN int8 ops in this build")
    monkeypatch.setattr(packed_module, "packing_available", lambda dtype=None: packed)
    monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)
    return decoding_copy(model, torch.int8 if int8 else torch.float32)


def _steps(model, src, beams: int, steps: int, cache_dtype=None) -> list[torch.Tensor]:
    """Logits of `steps` decoding steps, `beams` rows per sentence, random tokens."""
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        state = model.prefill(src, steps + 1, cache_dtype=cache_dtype)
        state.reorder(torch.arange(src.shape[0]).repeat_interleave(beams))
        logits = []
        for _ in range(steps):
            tokens = torch.randint(3, VOCAB, (src.shape[0] * beams, 1), generator=generator)
            logits.append(model.decode_step(tokens, state))
        return logits


def _assert_written_out_step_is_exact(model, run, scripted: bool | None = True) -> None:
    """run()'s logits with the written-out step (compiled by TorchScript or not) equal
    those of the modules, to the bit. scripted None: run() takes steps the written-out
    step does not cover, so it is never compiled."""
    step = model.decoder.fast_step
    assert step is not None
    if not scripted:
        model.decoder.fast_step = DecoderStep.build(model.decoder, script=False)
    try:
        written = run()
        assert model.decoder.fast_step.is_scripted == bool(scripted)
        model.decoder.fast_step = None
        plain = run()
    finally:
        model.decoder.fast_step = step
    assert len(written) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(written, plain))


@pytest.mark.parametrize("changes", [
    {}, {"norm_first": False}, {"activation": "gelu", "bias": False},
    {"num_kv_heads": 2}, {"num_kv_heads": 1, "positional": "learned"},
    {"scale_embeddings": False},
    {"gated_ffn": True, "activation": "silu", "norm": "rms", "bias": False},
    {"gated_ffn": True, "norm_first": False}, {"positional": "rotary", "num_kv_heads": 2},
    {"positional": "rotary", "bias": False, "qkv_bias": True},
    {"positional": "rotary", "num_kv_heads": 2, "qk_norm": True},
    {"qk_norm": True, "norm": "rms", "head_size": 8},
    {"positional": "t5", "norm": "rms", "bias": False, "head_size": 8},
    {"positional": "alibi", "num_kv_heads": 2},
    {"sandwich_norm": True, "norm_first": True, "norm": "rms", "positional": "rotary"},
    {"embedding_norm": True, "norm_first": True, "positional": "learned", "activation": "gelu"},
])
@pytest.mark.parametrize("packed,int8", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize("scripted", [True, False])
def test_the_written_out_step_gives_the_modules_logits(changes, packed, int8, beams,
                                                       scripted, monkeypatch):
    torch.manual_seed(0)
    model = copy_for_decoding(Transformer(tiny(**changes)).eval(), packed, int8, monkeypatch)
    src = padded([5, 2, 7], vocab=VOCAB)
    # Eight steps: TorchScript's executor optimizes its graph after the first few calls.
    _assert_written_out_step_is_exact(model, lambda: _steps(model, src, beams, 8), scripted)


def _language_model_and_padded_prompts(name: str, changes: dict, monkeypatch):
    """A decoding copy of a language model, three prompts (3, 6) and which of their
    tokens are real (3, 6): two rows left-padded."""
    torch.manual_seed(0)
    lm = build_model(preset(name, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                            max_positions=64, **changes)).eval()
    model = copy_for_decoding(lm, packing_available(torch.float32), False, monkeypatch)
    prompt = torch.randint(3, VOCAB, (3, 6))
    real = torch.ones(3, 6, dtype=torch.bool)
    real[0, :4], real[2, :1] = False, False                      # left padding
    return model, prompt, real


# Gemma 3's layers: sliding ones (a window longer than any output here: plain caches)
# around a full one with rotary positions of its own, sandwich norms, normalized queries
# and keys, scaled embeddings.
GEMMA3_LIKE = {"num_decoder_layers": 3, "attention_type": "sliding", "attention_window": 60,
               "full_attention_layers": (1,), "local_rope_base": 100.0, "sandwich_norm": True,
               "qk_norm": True, "scale_embeddings": True, "activation": "gelu-tanh"}


# Gemma 3's layers past their window (4 keys): the sliding layers' caches are windows
# (local.py's SlidingKVCache) from the prompt on.
GEMMA3_PAST_WINDOW = {**GEMMA3_LIKE, "attention_window": 4}

# Gemma 2's: sliding and full layers, sandwich norms, scores and logits soft-capped (caps
# small enough that the tanh bends them).
GEMMA2_LIKE = {"num_decoder_layers": 3, "attention_type": "sliding", "attention_window": 60,
               "full_attention_layers": (1,), "sandwich_norm": True, "scale_embeddings": True,
               "activation": "gelu-tanh", "attention_softcap": 0.8, "logit_softcap": 3.0}


# GPT-NeoX's (Pythia's) layers: parallel residuals, a quarter of each head rotated.
NEOX_LIKE = {"parallel_residual": True, "positional": "rotary", "rotary_dims": 4,
             "num_kv_heads": None, "gated_ffn": False, "activation": "gelu", "norm": "layer",
             "bias": True, "tie_embeddings": "none"}


# Phi's: parallel residuals over one norm, an output bias.
PHI_LIKE = {**NEOX_LIKE, "shared_norm": True, "output_bias": True, "activation": "gelu-tanh"}


# GPT-J's: Phi's layer with bias-free attention; StableLM 2 12B's: Llama's layer with
# LayerNorms, parallel over one norm, each head's queries and keys normalized with a gain
# of its own.
GPTJ_LIKE = {**PHI_LIKE, "attention_bias": False}
STABLELM_12B_LIKE = {"norm": "layer", "parallel_residual": True, "shared_norm": True,
                     "positional": "rotary", "rotary_dims": 4, "qk_norm": True,
                     "qk_norm_per_head": True}


# OLMo 2's layers: norms on the sub-layers' outputs alone, queries and keys normalized
# over all heads together.
OLMO2_LIKE = {"sandwich_norm": True, "input_norms": False, "qk_norm": True,
              "qk_norm_across_heads": True}


@pytest.mark.parametrize("name, changes", [("gpt-tiny", {}), ("llama-tiny", {}),
                                           ("llama-tiny", NEOX_LIKE),
                                           ("llama-tiny", PHI_LIKE),
                                           ("llama-tiny", GPTJ_LIKE),
                                           ("llama-tiny", STABLELM_12B_LIKE),
                                           ("llama-tiny", OLMO2_LIKE),
                                           ("gpt-tiny", {"positional": "alibi"}),
                                           ("llama-tiny", {"qk_norm": True}),
                                           ("llama-tiny", GEMMA3_LIKE),
                                           ("llama-tiny", GEMMA3_PAST_WINDOW),
                                           ("llama-tiny", {**GEMMA2_LIKE,
                                                           "attention_window": 3}),
                                           ("llama-tiny", GEMMA2_LIKE)])
@pytest.mark.parametrize("scripted", [True, False])
def test_left_padded_prompts_of_a_language_model_step_alike(name, changes, scripted,
                                                            monkeypatch):
    """A decoder-only model's steps carry a key mask and each row's positions (learned
    positions in GPT's layout, rotary in Llama's; ALiBi's bias joins the key mask)."""
    model, prompt, real = _language_model_and_padded_prompts(name, changes, monkeypatch)

    def run():
        with torch.inference_mode():
            state = model.prefill(prompt, 8, src_mask=real)
            tokens, logits = prompt[:, -1:], []
            for _ in range(5):
                logits.append(model.decode_step(tokens, state))
                tokens = logits[-1][:, -1].argmax(-1, keepdim=True)
            return logits

    _assert_written_out_step_is_exact(model, run, scripted)


@pytest.mark.parametrize("name, changes", [("gpt-tiny", {}), ("llama-tiny", {}),
                                           ("llama-tiny", NEOX_LIKE),
                                           ("llama-tiny", OLMO2_LIKE),
                                           ("llama-tiny", {"num_kv_heads": 1}),
                                           ("llama-tiny", GEMMA2_LIKE)])
@pytest.mark.parametrize("scripted", [True, False])
def test_steps_of_several_tokens_after_a_prompt_give_the_modules_logits(name, changes,
                                                                        scripted, monkeypatch):
    """Prompt lookup's steps: a language model's rows feed 2 to MAX_STEP_TOKENS tokens
    at once after a left-padded prompt, each attending to the cache and the new tokens
    before it, and the cache rewound between them, as the modules compute it."""
    model, prompt, real = _language_model_and_padded_prompts(name, changes, monkeypatch)

    def run():
        generator = torch.Generator().manual_seed(2)
        with torch.inference_mode():
            state = model.prefill(prompt, 40, src_mask=real)
            logits = []
            for new in (2, 5, 1, MAX_STEP_TOKENS, 3):
                tokens = torch.randint(3, VOCAB, (3, new), generator=generator)
                logits.append(model.decode_step(tokens, state))
                state.rewind(state.length - new // 2)
            return logits

    _assert_written_out_step_is_exact(model, run, scripted)
    with torch.inference_mode():
        state = model.prefill(prompt, 40, src_mask=real)
        step = model.decoder.fast_step
        assert step.covers(torch.zeros(3, MAX_STEP_TOKENS, dtype=torch.long), state.caches)
        assert not step.covers(torch.zeros(3, MAX_STEP_TOKENS + 1, dtype=torch.long),
                               state.caches)
        state.rewind(0)              # a prompt's own pass is the modules'
        assert not step.covers(torch.zeros(3, 2, dtype=torch.long), state.caches)


def test_where_torchscript_cannot_compile_the_step_runs_as_python(monkeypatch):
    def refuse(module):
        raise RuntimeError("no TorchScript here")

    monkeypatch.setattr(torch.jit, "script", refuse)
    torch.manual_seed(0)
    model = decoding_copy(Transformer(tiny()).eval())
    model.decoder.fast_step = DecoderStep.build(model.decoder)
    src = padded([5, 2], vocab=VOCAB)
    written = _steps(model, src, 2, 4)
    assert not model.decoder.fast_step.is_scripted
    model.decoder.fast_step = None
    assert all(torch.equal(a, b) for a, b in zip(written, _steps(model, src, 2, 4)))


def test_two_threads_stepping_the_same_compiled_model_get_their_own_logits():
    """Decoding workers share one decoding copy: its compiled step is reentrant. (One
    intra-op thread, as each worker has its share of the cores: the comparison is bit
    for bit, and a product split over threads another caller also uses need not give
    the same last bits.)"""
    torch.manual_seed(0)
    model = decoding_copy(Transformer(tiny()).eval())
    sources = [padded([5, 2, 7], vocab=VOCAB), padded([3, 6], vocab=VOCAB)]
    together = [None, None]

    def work(i):
        together[i] = _steps(model, sources[i], 2, 8)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = [_steps(model, src, 2, 8) for src in sources]
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        torch.set_num_threads(threads_before)
    assert model.decoder.fast_step.is_scripted
    for mine, theirs in zip(alone, together):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_a_full_cache_is_refused_by_name():
    model = decoding_copy(Transformer(tiny()).eval())
    src = padded([3], vocab=VOCAB)
    with torch.inference_mode():
        state = model.prefill(src, 2)
        model.decode_step(torch.full((1, 1), 5), state)
        model.decode_step(torch.full((1, 1), 5), state)
        with pytest.raises(ValueError, match="KV cache full: 2 cached \\+ 1 new > max_len 2"):
            model.decode_step(torch.full((1, 1), 5), state)


@pytest.mark.parametrize("changes", [{"attention_impl": "flash"}, {"attention_scale": False}])
def test_layouts_it_does_not_write_out_are_left_to_the_modules(changes):
    model = decoding_copy(Transformer(tiny(**changes)).eval())
    assert model.decoder.fast_step is None
    assert DecoderStep.build(decoding_copy(Transformer(tiny())).decoder) is not None


def test_it_covers_one_token_per_row_over_plain_caches_in_eval_mode():
    torch.manual_seed(0)
    model = decoding_copy(Transformer(tiny()).eval())
    step, src = model.decoder.fast_step, padded([4, 3], vocab=VOCAB)
    with torch.inference_mode():
        state = model.prefill(src, 4)
        quantized = model.prefill(src, 4, cache_dtype=torch.int8)
    one, two = torch.full((2, 1), 5), torch.full((2, 2), 5)
    with torch.no_grad():
        assert step.covers(one, state.caches)
        assert not step.covers(two, state.caches) and not step.covers(one, None)
        assert not step.covers(one, quantized.caches)
    assert not step.covers(one, state.caches)          # autograd on: the modules'
    with torch.no_grad():
        model.train()
        assert not step.covers(one, state.caches)
    assert isinstance(quantized.caches[0], QuantizedKVCache)
    # The int8 cache's steps run through the modules, with the same logits as before.
    model.eval()
    _assert_written_out_step_is_exact(
        model, lambda: _steps(model, src, 2, 3, cache_dtype=torch.int8), scripted=None)


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=pytest.mark.skipif(
    not one_query.available(), reason="the one-query kernel could not be built here"))])
@pytest.mark.parametrize("changes", [{}, {"num_kv_heads": 2}, {"norm_first": False},
                                     {"positional": "rotary"}, {"positional": "t5"}])
def test_runs_of_rows_read_their_own_slots_as_a_key_mask_would_let_them(changes, kernel):
    """A continuous search's rows: three runs whose sentences joined after 0, 2 and 3
    slots read only their slots (each run without a mask, or every row through the
    one-query kernel, which also reads each source's own keys where their lengths are
    given; under a score bias the runs become a float mask); the modules read every
    slot with the others masked. A single run
    from slot 0 is the unmasked step itself (bit for bit through PyTorch's kernel)."""
    torch.manual_seed(0)
    model = decoding_copy(Transformer(tiny(**changes)).eval())
    model.decoder.fast_step = DecoderStep(model.decoder, kernel=kernel)
    src = padded([5, 2, 7], vocab=VOCAB)
    runs, starts = [(0, 2, 0), (2, 4, 2), (4, 6, 3)], torch.tensor([0, 0, 2, 2, 3, 3])
    with torch.inference_mode():
        state = model.prefill(src, 8)
        state.reorder(torch.arange(3).repeat_interleave(2))
        for _ in range(4):
            model.decode_step(torch.randint(3, VOCAB, (6, 1)), state)
        tokens, step = torch.randint(3, VOCAB, (6, 1)), model.decoder.fast_step

        def fresh_caches():
            return [copy.deepcopy(cache) for cache in state.caches]

        mask = (torch.arange(5) >= starts[:, None])[:, None, None, :]      # (R, 1, 1, 5)
        by_runs = step(tokens, state.memory_kv, state.memory_mask, None, fresh_caches(),
                       None, row_runs=runs)
        model.decoder.fast_step = None
        masked = model.decoder(tokens, state.memory_kv, state.memory_mask, tgt_mask=mask,
                               caches=fresh_caches())
        unmasked = model.decoder(tokens, state.memory_kv, state.memory_mask,
                                 caches=fresh_caches())
        model.decoder.fast_step = step
        one_run = step(tokens, state.memory_kv, state.memory_mask, None, fresh_caches(), None,
                       row_runs=[(0, 6, 0)])
        lengths = state.memory_mask.reshape(3, -1).sum(dim=1)      # sources 5, 2, 7 + eos
        with_lengths = step(tokens, state.memory_kv, state.memory_mask, None, fresh_caches(),
                            None, row_runs=runs, memory_lengths=lengths)
        # within a few float32 roundings of values up to ~3 (other sums, other orders)
        assert torch.allclose(by_runs, masked, atol=3e-6, rtol=0)
        assert torch.allclose(with_lengths, masked, atol=3e-6, rtol=0)
        assert not torch.allclose(by_runs, unmasked, atol=1e-3)     # the runs do mask
        assert torch.equal(one_run, unmasked) or kernel and \
            torch.allclose(one_run, unmasked, atol=3e-6, rtol=0)
        assert step.kernel is kernel
        if changes.get("positional") != "t5":   # (a bias's mask runs on the plain layers)
            assert step._layers_for_runs(torch.float32).is_scripted
        with pytest.raises(ValueError, match="row_runs replace tgt_mask"):
            step(tokens, state.memory_kv, state.memory_mask, mask, fresh_caches(), None,
                 row_runs=runs)


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=pytest.mark.skipif(
    not one_query.available(), reason="the one-query kernel could not be built here"))])
def test_runs_of_a_capped_language_model_read_their_own_slots(kernel, monkeypatch):
    """Gemma 2's capped scores over row runs (a continuous batch's rows that joined at
    slots 0, 2 and 4): the capped layers make a call per run (the one-query kernel has no
    cap), the others go through the kernel where it is built; as the modules with a key
    mask give them."""
    model, prompt, _ = _language_model_and_padded_prompts("llama-tiny", GEMMA2_LIKE,
                                                          monkeypatch)
    model.decoder.fast_step = DecoderStep(model.decoder, kernel=kernel)
    runs, starts = [(0, 1, 0), (1, 2, 2), (2, 3, 4)], torch.tensor([0, 2, 4])
    with torch.inference_mode():
        state = model.prefill(prompt, 8)
        tokens, step = torch.randint(3, VOCAB, (3, 1)), model.decoder.fast_step
        positions = (5 - starts)[:, None]            # five slots cached: the prompt's first

        def fresh_caches():
            return [copy.deepcopy(cache) for cache in state.caches]

        by_runs = step(tokens, None, None, None, fresh_caches(), positions, row_runs=runs)
        model.decoder.fast_step = None
        mask = (torch.arange(6) >= starts[:, None])[:, None, None, :]       # (R, 1, 1, 6)
        masked = model.decoder(tokens, None, None, tgt_mask=mask, caches=fresh_caches(),
                               positions=positions)
        unmasked = model.decoder(tokens, None, None, caches=fresh_caches(),
                                 positions=positions)
    assert torch.allclose(by_runs, masked, atol=3e-6, rtol=0)
    assert not torch.allclose(by_runs, unmasked, atol=1e-3)                 # the runs mask


def test_a_window_past_its_keys_is_covered_one_token_at_a_time(monkeypatch):
    """Sliding layers past their window hold a window's cache: the step covers one token
    a row over it (every held key in the band), not several (the band would cut among
    them) nor a window holding keys for a rewind beyond it."""
    from transduce.attention.local import SlidingKVCache

    model, prompt, real = _language_model_and_padded_prompts("llama-tiny", GEMMA3_PAST_WINDOW,
                                                             monkeypatch)
    step, one = model.decoder.fast_step, torch.zeros(3, 1, dtype=torch.long)
    with torch.inference_mode():
        state = model.prefill(prompt, 8, src_mask=real)
        windows = [cache for cache in state.caches if type(cache) is SlidingKVCache]
        assert len(windows) == 2 and all(cache.held == 4 for cache in windows)
        assert step.covers(one, state.caches)
        assert not step.covers(torch.zeros(3, 2, dtype=torch.long), state.caches)
        model.decode_step(prompt[:, -1:], state)
        assert [cache.held for cache in windows] == [4, 4] and state.length == 6
        windows[0].allow_rewind(2)
        model.decode_step(prompt[:, -1:], state)          # it may keep 6 keys now
        assert windows[0].held == 5 and not step.covers(one, state.caches)
