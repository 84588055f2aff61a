"""Translation and generation jobs in continuous-batching streams: each job is answered
when its last text is done, with what offline translation or the Generator gives (a
streamed job's pieces join to it); other translators and settings batch whole."""

import pytest
import torch

from transduce import checkpoint, load
from transduce.config import preset
from transduce.data.tokenizer import MODEL_NAME
from transduce.model import build_model
from transduce.decode.generate import prompt_seeds
from transduce.decode.options import GenerateOptions
from transduce.serve.batcher import Job
from transduce.serve.continuous import generation_stream, translation_stream
from transduce.serve.generation import Prompts

from tests.serve.conftest import SENTENCES
from tests.serve.test_api import client_for


def job(texts):
    return Job(("translate",), lambda jobs: [], texts, 10 * len(texts), len(texts))


def run(stream, waves):
    """Admit each wave of jobs before a step, then step until all are answered ->
    {job: result} and the step at which each was answered."""
    answered, when, step = {}, {}, 0
    waves = list(waves)
    while waves or stream.running:
        if waves:
            stream.admit(waves.pop(0))
        for done, result in stream.step():
            answered[done], when[done] = result, step
        step += 1
    return answered, when


@pytest.mark.parametrize("beam,nbest", [(4, 2), (1, 1)])
def test_jobs_get_what_offline_translation_gives(translator, beam, nbest):
    assert translator.decodes_continuously
    stream = translation_stream(translator, beam, 0.6, nbest, None)(0)
    jobs = [job(SENTENCES[:3]), job(["", SENTENCES[3]]), job([""]), job(SENTENCES[4:])]
    answered, when = run(stream, [jobs[:2], [jobs[2]], [], [jobs[3]]])
    assert when[jobs[2]] == 1                  # only an empty text: answered at once
    for each in jobs:
        results, started, seconds = answered[each]
        expected = translator.translate_nbest(each.payload, nbest, beam=beam)
        # Scores to float rounding: the stream's rows attend in other company.
        assert [[t.text for t in hypotheses] for hypotheses in results] \
            == [[t.text for t in hypotheses] for hypotheses in expected]
        assert [[t.score for t in hypotheses] for hypotheses in results] \
            == [pytest.approx([t.score for t in hypotheses], abs=1e-4) for hypotheses in expected]
        assert seconds >= 0 and started > 0


def test_no_doubles_jobs_get_what_offline_translation_gives(translator):
    """A request's no_doubles reaches the continuous search: its texts get what
    Translator.translate(no_doubles=True) gives, which differs from the free search's."""
    from tests.serve.conftest import client_for

    with client_for(translator, max_chars=200, max_texts=16) as client:
        answer = client.post("/v1/translate", json={"texts": SENTENCES, "no_doubles": True})
        free = client.post("/v1/translate", json={"texts": SENTENCES})
    texts = [t["text"] for t in answer.json()["translations"]]
    assert texts == translator.translate(SENTENCES, no_doubles=True)
    assert texts != [t["text"] for t in free.json()["translations"]]
    # serve --no-doubles: the default of requests that do not say, LibreTranslate's too
    with client_for(translator, max_chars=200, max_texts=16, no_doubles=True) as client:
        unsaid = client.post("/v1/translate", json={"texts": SENTENCES})
        refused = client.post("/v1/translate", json={"texts": SENTENCES, "no_doubles": False})
        libre = client.post("/translate", json={"q": SENTENCES, "source": "es", "target": "en"})
    assert [t["text"] for t in unsaid.json()["translations"]] == texts
    assert refused.json() == {**free.json(), "timings": refused.json()["timings"]}
    assert libre.json()["translatedText"] == texts


def test_bfloat16_jobs_are_all_answered(translation_dir):
    """In bfloat16 any batching changes some outputs (static batches too), so only the
    answers' shape is checked."""
    translator = load(translation_dir, dtype="bfloat16")
    stream = translation_stream(translator, 3, 0.6, 2, None)(0)
    jobs = [job(SENTENCES[:5]), job([""] + SENTENCES[5:])]
    answered, _ = run(stream, [jobs[:1], [], [jobs[1]]])
    for each in jobs:
        results = answered[each][0]
        assert len(results) == len(each.payload)
        assert all(len(hypotheses) == 2 for hypotheses in results)


def test_quantized_caches_are_batched_continuously(translation_dir):
    """An int8 cache's jobs: offline translation's texts, each score within 1e-4 of its
    size (a key computed in other company can round to the next integer)."""
    quantized = load(translation_dir, kv_dtype="int8")
    assert quantized.decodes_continuously
    stream = translation_stream(quantized, 4, 0.6, 1, None)(0)
    jobs = [job(SENTENCES[:4]), job(SENTENCES[4:])]
    answered, _ = run(stream, [jobs[:1], [], [jobs[1]]])
    for each in jobs:
        results = answered[each][0]
        expected = quantized.translate_nbest(each.payload, 1, beam=4)
        assert [[t.text for t in h] for h in results] == [[t.text for t in h] for h in expected]
        assert [[t.score for t in h] for h in results] == \
            [pytest.approx([t.score for t in h], rel=1e-4) for h in expected]


# ------------------------------------------------------------------ generation streams

class _Posted:
    """A generate job's payload (serve/generation.py's Prompts) that records what a
    streamed job posts instead of handing it to an event loop."""

    def __init__(self, texts, options, seeds=None, streamed=False):
        self.texts, self.options, self.seeds, self.posted = texts, options, seeds, []
        self.pieces = self.posted if streamed else None

    def __len__(self):
        return len(self.texts)

    def post(self, index, text):
        self.posted.append((index, text))

    result = staticmethod(Prompts.result)


def prompts_job(payload, options):
    return Job(("generate", payload.pieces is not None, options), lambda jobs: [], payload,
               10 * len(payload), len(payload))


def test_generation_jobs_of_any_settings_get_what_the_generator_gives(generator):
    """Greedy and sampled jobs of different settings share one stream, each prompt
    generated as alone with its job's settings, whole or streamed."""
    settings = [{}, {"temperature": 0.9, "top_p": 0.95},
                {"repetition_penalty": 1.5},
                {"frequency_penalty": 1.0, "logit_bias": {6: -100}},
                {"max_new_tokens": 6, "stop": ("a",)},
                {"temperature": 1.1, "top_k": 30, "max_new_tokens": 9}]
    options = [GenerateOptions(**{"max_new_tokens": 14, **each}) for each in settings]
    stream = generation_stream(generator, options[0])(0)
    seeds = (lambda n, s, o: None if o.greedy else prompt_seeds(s, n))
    payloads = [_Posted(SENTENCES[:3], options[0]),
                _Posted(["", SENTENCES[3]], options[1], seeds(2, 2, options[1])),
                _Posted(SENTENCES[4:6], options[2], seeds(2, 3, options[2]), streamed=True),
                _Posted(SENTENCES[6:], options[3]),
                _Posted(SENTENCES[1:4], options[4], seeds(3, 4, options[4]), streamed=True)]
    jobs = [prompts_job(payload, payload.options) for payload in payloads]
    answered, when = run(stream, [jobs[:2], [jobs[2]], [], [jobs[4]], [], [jobs[3]]])
    for each in jobs:
        texts, started, seconds = answered[each]
        expected = generator.generate(each.payload.texts, each.payload.options,
                                      seeds=each.payload.seeds)
        assert texts == expected          # streamed ones too, once done
        if each.payload.pieces is not None:
            joined = ["".join(t for i, t in each.payload.posted if i == index)
                      for index in range(len(expected))]
            assert joined == expected
        assert seconds >= 0 and started > 0
    assert len(set(when.values())) > 1          # jobs left at different steps
    # in pieces, each ending at a word's end
    assert len(payloads[2].posted) > len(payloads[2].texts)


def test_beam_search_is_batched_whole_and_a_quantized_cache_continuously(generator, lm_dir):
    assert generation_stream(generator, GenerateOptions(beam=2)) is None
    assert generation_stream(load(lm_dir, kv_dtype="int8"), GenerateOptions()) is not None


def test_sliding_layers_among_full_ones_are_batched_continuously(tiny_corpus, tmp_path):
    """A Gemma-like stack (one full layer among sliding ones, a window of 2 keys) has a
    continuous stream, its sliding layers' caches keeping their band: the server's
    answers are what the Generator gives each prompt alone. Its int8 cache has none (the
    server then generates whole batches)."""
    torch.manual_seed(0)
    model = build_model(preset("llama-tiny", src_vocab_size=300, tgt_vocab_size=300,
                               num_decoder_layers=3, attention_type="sliding",
                               attention_window=2, full_attention_layers=(1,),
                               local_rope_base=100.0, sandwich_norm=True))
    checkpoint.save(tmp_path / "model", model, None, tiny_corpus / MODEL_NAME)
    generator = load(tmp_path / "model")
    assert generation_stream(generator, GenerateOptions()) is not None
    assert generation_stream(load(tmp_path / "model", kv_dtype="int8"),
                             GenerateOptions()) is None
    prompts = ["uno dos", "el perro grande come", "casa"]
    with client_for(generator, max_texts=16, continuous=True) as client:
        answer = client.post("/v1/generate", json={"prompts": prompts, "max_new_tokens": 12})
    assert answer.status_code == 200, answer.text
    assert answer.json()["generations"] == [
        generator.generate([prompt], GenerateOptions(max_new_tokens=12))[0]
        for prompt in prompts]
