"""Tokens' log-probabilities (decode/token_logprobs.py) against a float64 pass of the
model and against transformers for an imported GPT-2, batched equal to one at a time,
the cached greedy steps' choice the likeliest; each token's piece of its text
(decode/token_spans.py) against decoding every prefix whole, across windows, with
characters split over several byte-level tokens."""

import pytest
import torch

from tests.test_export_decoder import VOCAB, saved_language_model
from tests.test_import_gpt2 import EOT, bpe, hf_checkpoint  # noqa: F401 - bpe: a fixture
from transduce.data.hf_tokenizer import HFTokenizer
from transduce.decode.generate import Generator, PromptError, PromptIds
from transduce.decode.token_spans import decoded_after, token_offsets, token_strings
from transduce.importers import import_gpt2
from transduce.model import int8 as int8_module

transformers = pytest.importorskip("transformers")

SEQUENCES = [[1, 5, 9, 33, 7, 7, 120], [1, 44], [2], [1, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 60, 3],
             [250, 3, 17]]
TOP = 4


@pytest.fixture(scope="module")
def language_model(tiny_corpus, tmp_path_factory):
    model, path = saved_language_model(tmp_path_factory.mktemp("lm"), tiny_corpus, "llama-tiny")
    return model, Generator.load(path)


def reference(model, sequence):
    """float64 log-probabilities of sequence[1:] and the float64 log-softmax rows."""
    with torch.no_grad():
        logits = model.double()(torch.tensor([sequence]))[0, :-1]
    model.float()
    rows = torch.log_softmax(logits, dim=-1)
    return rows.gather(1, torch.tensor(sequence[1:])[:, None])[:, 0], rows


def test_log_probabilities_are_the_float64_models(language_model):
    model, generator = language_model
    found = generator.token_logprobs(SEQUENCES, TOP)
    for sequence, scores in zip(SEQUENCES, found):
        expected, rows = reference(model, sequence)
        assert len(scores.logprobs) == len(scores.top) == len(sequence) - 1
        torch.testing.assert_close(torch.tensor(scores.logprobs, dtype=torch.float64), expected,
                                   atol=1e-4, rtol=0)
        for place, best in enumerate(scores.top):
            values, ids = rows[place].topk(TOP)
            assert [token for token, _ in best] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in best], dtype=torch.float64),
                                       values, atol=1e-4, rtol=0)


def test_batched_equals_one_at_a_time(language_model):
    _, generator = language_model
    together = generator.token_logprobs(SEQUENCES, 2)
    for sequence, scores in zip(SEQUENCES, together):
        (alone,) = generator.token_logprobs([sequence], 2)
        assert scores.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert [[i for i, _ in best] for best in scores.top] == \
            [[i for i, _ in best] for best in alone.top]


def test_small_batches_and_no_top_give_the_same(language_model):
    from transduce.decode.token_logprobs import token_logprobs

    _, generator = language_model
    whole = generator.token_logprobs(SEQUENCES)
    small = token_logprobs(generator.model, SEQUENCES, batch_tokens=8)
    for one, other in zip(small, whole):
        assert one.logprobs == pytest.approx(other.logprobs, abs=1e-5)
    assert all(best == [] for s in whole for best in s.top)


@pytest.mark.parametrize("dtype,within", [("bfloat16", 0.05), pytest.param(
    "int8", 0.1, marks=pytest.mark.skipif(not int8_module.int8_available(),
                                          reason="no oneDNN int8 ops in this build"))])
def test_a_lower_precision_copy_scores_near_float32(language_model, dtype, within,
                                                    monkeypatch):
    """Off by 0.021 (bfloat16) and 0.047 (int8) on a Zen 4; a shifted target would be
    off by up to 2."""
    model, generator = language_model
    monkeypatch.setattr(int8_module, "MIN_INT8_WEIGHTS", 0)      # every product in int8
    lower = Generator(model, generator.tokenizer, dtype=dtype)
    for exact, near in zip(generator.token_logprobs(SEQUENCES), lower.token_logprobs(SEQUENCES)):
        assert near.logprobs == pytest.approx(exact.logprobs, abs=within)


def test_the_cached_greedy_steps_choose_the_likeliest_token(language_model):
    _, generator = language_model
    prompts = ["uno dos tres", "el gato come", ""]
    rows = generator.generate_rows(prompts, max_new_tokens=8)
    sequences = [ids + row.tokens for ids, row in zip(generator.encode(prompts), rows)]
    for ids, row, scores in zip(generator.encode(prompts), rows,
                                generator.token_logprobs(sequences, 1)):
        for place in range(len(ids) - 1, len(ids) - 1 + len(row.tokens)):
            assert scores.top[place][0][1] == pytest.approx(scores.logprobs[place], abs=1e-5)


def test_a_sequence_longer_than_the_model_reads_is_refused(language_model):
    _, generator = language_model
    too_long = [1] * (generator.context + 2)
    with pytest.raises(PromptError, match="sequence 2: .* tokens"):
        generator.token_logprobs([[1, 2], too_long])


def test_prompt_ids_are_read_as_they_are(language_model):
    _, generator = language_model
    (words,) = generator.tokenizer.encode(["uno dos"])
    assert generator.encode([PromptIds([5, 6]), "uno dos"]) == [[5, 6], [1, *words]]
    with pytest.raises(PromptError, match=rf"prompt 2: token 1 is {VOCAB}, not an id"):
        generator.encode(["uno", PromptIds([5, VOCAB])])
    with pytest.raises(PromptError, match="prompt 1: no token ids"):
        generator.encode([PromptIds([])])
    assert generator.generate([PromptIds([1, *words])], max_new_tokens=5) == \
        generator.generate(["uno dos"], max_new_tokens=5)


def test_an_imported_gpt2_scores_as_transformers(bpe, tmp_path):  # noqa: F811
    hf = hf_checkpoint(tmp_path / "hf", bpe / "json", n_layer=2, n_head=2, n_embd=32,
                       n_positions=64)
    generator = Generator.load(import_gpt2(tmp_path / "hf", tmp_path / "ours"))
    sequences = [generator.tokenizer.encode([text])[0] for text in
                 ("The quick brown fox jumps", "Emoji: 🎉🙂 and 日本語", "a")]
    for sequence, scores in zip(sequences, generator.token_logprobs(sequences, 3)):
        with torch.no_grad():
            rows = torch.log_softmax(hf(torch.tensor([sequence])).logits[0, :-1].double(), -1)
        expected = rows.gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]
        assert scores.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
        assert [[i for i, _ in best] for best in scores.top] == rows.topk(3).indices.tolist()


def prefix_offsets(tokenizer, ids):
    """Where each token begins by decoding every prefix whole (quadratic, exact)."""
    return [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids) + 1)]


TEXTS = ["Hello world! The quick brown fox jumps over the lazy dog. " * 3,
         "Emoji: 🎉🙂👍🏽 and more 🎉, 日本語のテキストと中文的句子。 Ça coûte 12,50 €.",
         "El niño comió una manzana en la mañana; ¿verdad que sí? ¡Claro!", "a", ""]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_byte_level_pieces_join_to_the_text_and_begin_where_prefixes_end(bpe, text):  # noqa: F811
    tokenizer = HFTokenizer.from_file(bpe / "json" / "tokenizer.json", bos=EOT, eos=EOT)
    (ids,) = tokenizer.encode([text])
    offsets = token_offsets(tokenizer, ids, text)
    assert "".join(token_strings(text, offsets)) == text
    assert offsets == prefix_offsets(tokenizer, ids)
    if text.startswith("Emoji"):        # characters spread over several tokens
        assert "" in token_strings(text, offsets) and len(ids) > len(text.encode()) // 4


def test_sentencepiece_pieces_keep_their_spaces_after_a_context(tiny_corpus):
    from transduce.data.tokenizer import Tokenizer, MODEL_NAME

    tokenizer = Tokenizer(tiny_corpus / MODEL_NAME)
    words = "uno dos tres casa el perro gato rojo grande come " * 6
    (ids,) = tokenizer.encode([words])
    assert len(ids) > 40                                     # past one window
    offsets = token_offsets(tokenizer, ids, words.strip())
    assert offsets == [min(o, len(words.strip())) for o in prefix_offsets(tokenizer, ids)]
    word = next(k for k in range(5, len(ids)) if tokenizer.piece(ids[k]).startswith("\u2581"))
    context, rest = ids[:word], ids[word:]
    text = decoded_after(tokenizer, context, rest)
    assert text.startswith(" ") and tokenizer.decode(ids) == tokenizer.decode(context) + text
    pieces = token_strings(text, token_offsets(tokenizer, rest, text, context))
    assert "".join(pieces) == text and pieces[0].startswith(" ")


def test_a_text_cut_short_leaves_the_tokens_after_the_cut_empty(tiny_corpus):
    from transduce.data.tokenizer import Tokenizer, MODEL_NAME

    tokenizer = Tokenizer(tiny_corpus / MODEL_NAME)
    (ids,) = tokenizer.encode(["uno dos tres casa"])
    cut = tokenizer.decode(ids)[:6]
    offsets = token_offsets(tokenizer, ids, cut)
    assert offsets[-1] == len(cut) and offsets == sorted(offsets)
    assert "".join(token_strings(cut, offsets)) == cut and token_strings(cut, offsets)[-1] == ""
