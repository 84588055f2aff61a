"""POST /v1/attention: every attention map of what the model does with a text, in each
of the three shapes: a translation's (encoder self-, decoder self- and
cross-attention), an encoder-only model's pass over a text or a pair (self-attention),
a language model's greedy continuation of a prompt (causal self-attention).

The maps are those of attention_maps.py, computed on the decoding worker one request at
a time and answered in streamed pieces (attention_answer.py); "rollout" answers their
rollout through each stack's self-attention layers instead. Offered where the model
records them: a PyTorch model, not an ONNX export.
"""

from __future__ import annotations

from fastapi import APIRouter

from transduce.attention_maps import AttentionMaps, attention_maps, encoder_attention_maps, \
    generation_attention_maps
from transduce.decode.encode import SentenceEncoder
from transduce.decode.generate import Generator, with_bos
from transduce.decode.translate import Translator
from transduce.serve.attention_answer import KINDS, MapsAnswers
from transduce.serve.encoding import item_markers, token_counts
from transduce.serve.limits import ApiError, check_texts, check_tokens
from transduce.serve.schemas import AttentionRequest, AttentionResponse, \
    EncoderAttentionRequest, EncoderAttentionResponse, GenerationAttentionRequest, \
    GenerationAttentionResponse
from transduce.serve.service import Service
from transduce.serve.validation import ERROR_RESPONSES, checked_direction


def serves_attention_maps(model: Translator | SentenceEncoder | Generator) -> bool:
    """Whether /v1/attention is offered: a PyTorch model records its maps; an ONNX
    export's graph returns none."""
    return hasattr(model.model, "attention_modules")


def routes(service: Service, kind: str) -> APIRouter:
    """POST /v1/attention for the model's kind ("translation", "encoder" or
    "generation"), where the model records its maps (else no route)."""
    router = APIRouter()
    if not serves_attention_maps(service.model):
        return router
    route, response, summary = {
        "translation": (_translation_route, AttentionResponse,
                        "A translation with every attention map of it"),
        "encoder": (_encoder_route, EncoderAttentionResponse,
                    "Every self-attention map of the model's pass over a text or a pair"),
        "generation": (_generation_route, GenerationAttentionResponse,
                       "A prompt's greedy continuation with every attention map of it"),
    }[kind]
    router.add_api_route("/v1/attention", route(service), methods=["POST"],
                         response_model=response, responses=ERROR_RESPONSES, summary=summary)
    return router


def _translation_route(service: Service):
    translator: Translator = service.model
    answers = MapsAnswers(service, KINDS)

    def compute(key: tuple) -> AttentionMaps:
        text, beam, alpha, (source, target), no_doubles = key
        return attention_maps(translator, text, beam=beam, alpha=alpha, source_lang=source,
                              target_lang=target, no_doubles=no_doubles)

    async def attention(body: AttentionRequest):
        kinds = answers.kinds(body.kinds, "kinds" in body.model_fields_set, body.rollout)
        selected = answers.selected(kinds, body.layers)
        check_texts([body.text], service.limits, "text", indexed=False)
        _check_not_blank(body.text, "text", "a sentence to translate")
        way = checked_direction(translator, body, service.languages)
        limit = translator.max_source_tokens - 1 - len(way.source_prefix)
        length = len(translator.tokenizer.encode([body.text.strip()])[0])
        check_tokens([length], limit, "text", body.truncate, indexed=False)
        no_doubles = service.limits.no_doubles if body.no_doubles is None else body.no_doubles
        key = (body.text, body.beam, float(body.alpha), way.languages or (None, None),
               no_doubles)
        maps = await answers.maps(key, compute, min(length, limit) + 1, body.rollout)
        head = {"translation": maps.translation, "log_prob": maps.log_prob,
                "source_tokens": maps.source_tokens, "target_inputs": maps.target_inputs,
                "target_outputs": maps.target_outputs}
        return answers.response(head, maps, selected, body.decimals)

    return attention


def _encoder_route(service: Service):
    encoder: SentenceEncoder = service.model
    answers = MapsAnswers(service, ("encoder",))

    def compute(key: tuple) -> AttentionMaps:
        return encoder_attention_maps(encoder, *key)

    async def attention(body: EncoderAttentionRequest):
        selected = answers.selected(["encoder"], body.layers)
        texts = [body.text] if body.text_pair is None else [body.text, body.text_pair]
        for text, field in zip(texts, ("text", "text_pair")):
            check_texts([text], service.limits, field, indexed=False)
            _check_not_blank(text, field, "a text to encode")
        markers = item_markers(encoder.model.config, pairs=len(texts) == 2)
        limit = encoder.model.config.max_positions - markers
        length = sum(token_counts(encoder, texts))
        if body.text_pair is None:
            check_tokens([length], limit, "text", body.truncate, indexed=False)
        elif length > limit and not body.truncate:
            raise ApiError(413, f"text and text_pair: {length} tokens together, more than "
                                f"the model's limit of {limit} for a pair; send \"truncate\": "
                                f"true to cut them instead", "text_pair")
        maps = await answers.maps((body.text, body.text_pair), compute,
                                  min(length, limit) + markers, body.rollout)
        return answers.response({"text": maps.translation, "tokens": maps.source_tokens},
                                maps, selected, body.decimals)

    return attention


def _generation_route(service: Service):
    generator: Generator = service.model
    answers = MapsAnswers(service, ("decoder",))

    def compute(key: tuple) -> AttentionMaps:
        prompt, max_new_tokens = key
        return generation_attention_maps(generator, prompt, max_new_tokens=max_new_tokens)

    async def attention(body: GenerationAttentionRequest):
        selected = answers.selected(["decoder"], body.layers)
        check_texts([body.prompt], service.limits, "prompt", indexed=False)
        length = len(with_bos(generator.tokenizer.encode([body.prompt])[0],
                              generator.tokenizer))
        if length >= generator.context:
            raise ApiError(413, f"prompt: {length} tokens, but the model reads "
                                f"{generator.context} positions in all (prompt and "
                                f"continuation)", "prompt")
        new_tokens = min(body.max_new_tokens, generator.context - length)
        maps = await answers.maps((body.prompt, new_tokens), compute, length + new_tokens,
                                  body.rollout)
        head = {"prompt": body.prompt, "continuation": maps.translation[len(body.prompt):],
                "log_prob": maps.log_prob, "inputs": maps.target_inputs,
                "outputs": maps.target_outputs}
        return answers.response(head, maps, selected, body.decimals)

    return attention


def _check_not_blank(text: str, field: str, wanted: str) -> None:
    if not text.strip():
        raise ApiError(422, f"{field}: only white space; give {wanted}", field)
