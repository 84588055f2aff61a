"""Request and response bodies of the API, as pydantic models (they make /openapi.json).

Requests are strict: unknown fields, strings for numbers, floats for integers, empty
lists and lone surrogates (text no UTF-8 can carry) are refused with 422 naming the
field. Ranges that depend on the loaded model (max_length, max_new_tokens) and limits
set at start-up (max_chars, max_texts: 413) are checked by the routes.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, \
    StrictInt, StrictStr, ValidationError, ValidatorFunctionWrapHandler, WrapValidator, \
    model_validator
from pydantic_core import PydanticCustomError

MAX_BEAM = 16


def _no_surrogates(text: str) -> str:
    """JSON's \\ud800 escapes can smuggle halves of UTF-16 pairs, which are no text."""
    if any("\ud800" <= c <= "\udfff" for c in text):
        raise ValueError("contains a lone surrogate (\\ud800-\\udfff), which is not text")
    return text


Text = Annotated[StrictStr, AfterValidator(_no_surrogates)]
Texts = Annotated[list[Text], Field(min_length=1)]
Number = StrictFloat | StrictInt
Beam = Annotated[StrictInt, Field(ge=1, le=MAX_BEAM, description="hypotheses kept per "
                                                                   "sentence (1: greedy)")]
Alpha = Annotated[Number, Field(ge=0, le=10, allow_inf_nan=False,
                                description="GNMT length penalty exponent")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LanguagePair(Strict):
    """A multilingual model's languages (decode/languages.py); a one-pair model takes
    none, or its own."""

    source_lang: StrictStr | None = Field(None, examples=["eng_Latn"], description=(
        "a multilingual model's source language, one of its codes (default: the pair it "
        "records)"))
    target_lang: StrictStr | None = Field(None, examples=["fra_Latn"], description=(
        "a multilingual model's target language, one of its codes"))


NoDoubles = Annotated[StrictBool | None, Field(description=(
    "a token never directly follows itself (a briefly trained model's 'God God God'; "
    "not for languages that double characters); default: the server's "
    "(serve --no-doubles)"))]


class TranslateRequest(LanguagePair):
    texts: Texts = Field(description="sentences to translate, one per item")
    beam: Beam = 4
    alpha: Alpha = 0.6
    nbest: Annotated[StrictInt, Field(ge=1, le=MAX_BEAM)] = 1
    max_length: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="output tokens at most (default: the source's length + 50)")
    truncate: StrictBool = Field(False, description="cut texts over the model's length "
                                                    "limit instead of refusing them (413)")
    no_doubles: NoDoubles = None


class Hypothesis(BaseModel):
    text: str
    score: float


class Translated(BaseModel):
    text: str
    score: float
    truncated: bool
    nbest: list[Hypothesis] | None = None


class Timings(BaseModel):
    queue_ms: float = Field(description="waiting for the decoding worker")
    decode_ms: float = Field(description="the batch this request was decoded in")
    total_ms: float


class TranslateResponse(BaseModel):
    translations: list[Translated]
    timings: Timings


class LibreTranslateRequest(Strict):
    """LibreTranslate's /translate body (JSON or form-encoded)."""

    q: Text | Texts
    source: StrictStr = Field("auto", examples=["es", "auto"],
                              description="the model's source language, or auto")
    target: StrictStr = Field(examples=["en"], description="the model's target language")
    format: Literal["text"] = Field("text", description="only plain text is translated")
    alternatives: Annotated[StrictInt, Field(ge=0, le=MAX_BEAM - 1)] = 0
    api_key: StrictStr | None = Field(None, description="accepted and ignored")


OneText = Annotated[StrictStr, Field(min_length=1), AfterValidator(_no_surrogates)]
MapLayers = Annotated[Annotated[list[Annotated[StrictInt, Field(ge=1)]], Field(min_length=1)]
                      | None, Field(description="1-based layers to return (default: all)")]
Decimals = Annotated[StrictInt, Field(ge=1, le=6, description="digits of each weight")]
Rollout = Annotated[StrictBool, Field(description=(
    "each stack's self-attention rolled out through its layers (Abnar & Zuidema 2020: "
    "heads averaged, the residual's identity mixed in half and half, multiplied up from "
    "the first layer): one map a layer, what each position there draws on each input "
    "position; a translation's cross-attention is left out"))]
Maps = Annotated[dict[str, dict[str, list[list[list[float]]]]], Field(
    description="kind -> layer (1-based) -> heads x queries x keys")]


class AttentionRequest(LanguagePair):
    text: OneText
    beam: Beam = 4
    alpha: Alpha = 0.6
    kinds: Annotated[list[Literal["encoder", "decoder", "cross"]], Field(min_length=1)] = [
        "encoder", "decoder", "cross"]
    layers: MapLayers = None
    decimals: Decimals = 3
    truncate: StrictBool = False
    no_doubles: NoDoubles = None
    rollout: Rollout = False


class AttentionResponse(BaseModel):
    translation: str
    log_prob: float
    source_tokens: list[str] = Field(description="encoder input pieces, eos included")
    target_inputs: list[str] = Field(description="decoder input pieces: bos, the output")
    target_outputs: list[str] = Field(description="what each decoder position predicts")
    layers: dict[str, int] = Field(description="layers per kind")
    heads: int
    maps: Maps


class EncoderAttentionRequest(Strict):
    text: OneText
    text_pair: OneText | None = Field(None, description=(
        "a second text, read as a classifier of pairs reads it: [CLS] text [SEP] second "
        "[SEP]"))
    layers: MapLayers = None
    decimals: Decimals = 3
    truncate: StrictBool = Field(False, description="cut a text (pair) over the model's "
                                                    "length instead of refusing it (413)")
    rollout: Rollout = False


class EncoderAttentionResponse(BaseModel):
    text: str = Field(description="the text (a pair: \"text | second\")")
    tokens: list[str] = Field(description="the pieces the model reads, [CLS] and [SEP] "
                                          "included: the queries and the keys")
    layers: dict[str, int] = Field(description="{\"encoder\": layers}")
    heads: int
    maps: Maps


class GenerationAttentionRequest(Strict):
    prompt: Text = Field(description="the text to continue (empty: from bos alone)")
    max_new_tokens: Annotated[StrictInt, Field(ge=1, le=4096)] = 32
    layers: MapLayers = None
    decimals: Decimals = 3
    rollout: Rollout = False


class GenerationAttentionResponse(BaseModel):
    prompt: str
    continuation: str = Field(description="the greedy continuation the maps are of")
    log_prob: float = Field(description="of the continuation, by the recorded pass")
    inputs: list[str] = Field(description="the piece each position reads: the keys")
    outputs: list[str] = Field(description="the piece each position is followed by: the "
                                           "queries' rows")
    layers: dict[str, int] = Field(description="{\"decoder\": layers}")
    heads: int
    maps: Maps


# OpenAI's penalties and logit bias (decode/penalties.py), on /v1/generate and its API.
Penalty = Annotated[Number, Field(ge=-2, le=2, allow_inf_nan=False)]
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                           Annotated[Number, Field(ge=-100, le=100, allow_inf_nan=False)]],
                      Field(max_length=300)] | None
FREQUENCY = "-2 to 2: a token's logit lowered by this times how often the text has it"
MinP = Annotated[Number, Field(ge=0, le=1, allow_inf_nan=False)]
MIN_P = "0 to 1: sample among tokens at least this times as likely as the likeliest (0: all)"
PRESENCE = "-2 to 2: a token's logit lowered by this once the text has it"
BIAS = ("token id (a string) -> -100 to 100, added to its logit (-100 bans it); at most "
        "300")


class GenerateRequest(Strict):
    prompts: Texts = Field(description="texts to continue, one per item (an empty one: "
                                       "generate from the model's bos alone)")
    max_new_tokens: Annotated[StrictInt, Field(ge=1)] = 64
    temperature: Annotated[Number, Field(ge=0, le=100, allow_inf_nan=False)] = 0.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0
    top_p: Annotated[Number, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    min_p: MinP = Field(0, description=MIN_P)
    seed: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0, le=100, allow_inf_nan=False)] = 1.0
    frequency_penalty: Penalty = Field(0, description=FREQUENCY)
    presence_penalty: Penalty = Field(0, description=PRESENCE)
    logit_bias: LogitBias = Field(None, description=BIAS)
    stop: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=16)] = []
    json_schema: dict[str, Any] | None = Field(
        None, description="a JSON Schema every generation is an instance of ({\"type\": "
                          "\"object\"}: any JSON object); greedy or sampled, beam 1")
    beam: Beam = 1
    alpha: Alpha = 0.6
    stream: StrictBool = Field(False, description="server-sent events, one per piece")


class GenerateResponse(BaseModel):
    generations: list[str]
    timings: Timings


class EmbedRequest(Strict):
    texts: Texts
    normalize: StrictBool | None = Field(
        None, description="L2-normalise; default: as the model records, else false")
    pooling: Literal["mean", "cls"] | None = Field(
        None, description="mean over the tokens or [CLS]'s state; default: as the model "
                          "records, else mean")
    truncate: StrictBool = False


class EmbedResponse(BaseModel):
    embeddings: list[list[float]]
    dimensions: int
    pooling: str
    normalized: bool
    truncated: list[bool]
    timings: Timings


class ClassifyRequest(Strict):
    texts: Texts
    text_pairs: Texts | None = Field(
        default=None, description="each text's second text, for a classifier of pairs "
        "(entailment, paraphrase): [CLS] text [SEP] second [SEP]")
    truncate: StrictBool = False


class Prediction(BaseModel):
    label: str
    probability: float
    probabilities: dict[str, float]


class ClassifyResponse(BaseModel):
    predictions: list[Prediction]
    truncated: list[bool]
    timings: Timings


class TagRequest(Strict):
    texts: Texts = Field(description="each text's words (split at whitespace) are tagged; "
                                     "a text longer than the model reads is tagged in "
                                     "chunks of whole words")


class TaggedWord(BaseModel):
    word: str
    tag: str
    probability: float


class Entity(BaseModel):
    """A run of words of one kind from BIO tags: words [start, end) of the text."""

    kind: str
    start: int
    end: int
    text: str


class TagResponse(BaseModel):
    words: list[list[TaggedWord]]
    entities: list[list[Entity]]
    timings: Timings


class AnswerRequest(Strict):
    questions: Texts
    contexts: Texts = Field(description="each question's context, which its answer is "
                                        "a span of; a long one is read in windows")
    top_k: Annotated[StrictInt, Field(ge=1, le=20)] = 1
    max_answer_tokens: Annotated[StrictInt, Field(ge=1, le=512)] = 30
    no_answer: StrictBool = Field(False, description="the empty answer (text \"\", start "
                                                     "and end 0) competes with the spans")


class FoundAnswer(BaseModel):
    text: str
    start: int = Field(description="the answer's first character in its context")
    end: int = Field(description="past its last character")
    score: float


class AnswerResponse(BaseModel):
    answers: list[list[FoundAnswer]]
    timings: Timings


class ErrorBody(BaseModel):
    error: str
    field: str | None = None


FunctionName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                                           examples=["get_weather"])]


class CalledFunction(Strict):
    name: Annotated[Text, Field(min_length=1, examples=["get_weather"])]
    arguments: Text = Field(description="the call's arguments: a JSON object's text",
                            examples=['{"city": "Tokyo"}'])


class MessageToolCall(Strict):
    """A call an earlier reply made, as this API gave it."""

    id: Annotated[Text, Field(examples=["call_0"])]
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"role": "user", "content": "What is attention?"}]})

    role: Annotated[StrictStr, Field(min_length=1, examples=["user"],
                                     description="system, user, assistant or tool (a "
                                                 "template may take others)")]
    content: Text | None = Field(None, description=(
        "the text (or OpenAI's list of {\"type\": \"text\", \"text\": ...} parts, "
        "joined by newlines); null for an assistant's turn of tool calls alone"))
    reasoning_content: Text | None = Field(
        None, description="an earlier reply's reasoning, as this API gave it; a thinking "
                          "model's template may write it back")
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=128)] | None = Field(
        None, description="an earlier reply's calls, as this API gave them")
    tool_call_id: Text | None = Field(None, description="a tool's result: the call's id")
    name: Text | None = Field(None, description="a tool's result: the function's name")

    @model_validator(mode="before")
    @classmethod
    def _text_of_parts(cls, value: Any) -> Any:
        """Content given as OpenAI's parts (LangChain's and the SDK's typed messages send
        them): the text parts joined by newlines, as vLLM gives them to a template that
        reads text; a part of another kind (an image) is refused, naming it."""
        if isinstance(value, dict) and isinstance(value.get("content"), list):
            value = {**value, "content": _joined_text_parts(value["content"])}
        return value


MAX_PARTS = 64


def _joined_text_parts(parts: list) -> str:
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"content: {len(parts)} parts; give 1 to {MAX_PARTS}")
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or set(part) != {"type", "text"} \
                or not isinstance(part["text"], str):
            shown = f"a part of type {kind!r}" if isinstance(kind, str) else "not a part"
            raise ValueError(f"content[{index}]: {shown}; this server's models read "
                             f"{{\"type\": \"text\", \"text\": ...}} parts alone")
        texts.append(part["text"])
    return "\n".join(texts)


class FunctionSpec(Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of its "
                                                                "arguments")
    strict: StrictBool | None = Field(None, description="accepted; the arguments of "
                                                        "forced calls follow the schema")


class Tool(Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city now.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})

    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: ChosenFunction


class JsonSchemaFormat(Strict):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] = Field(
        description="the schema's name, as OpenAI takes it")
    description: Text | None = None
    schema_: dict[str, Any] | StrictBool = Field(
        True, alias="schema", description="the JSON Schema every reply is an instance of "
                                          "(decode/json_schema.py says what is enforced)")
    strict: StrictBool | None = Field(None, description="accepted: a reply always follows "
                                                        "the schema here")


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat,
                           Field(discriminator="type")]
RESPONSE_FORMAT = ("{\"type\": \"text\"} (the default), {\"type\": \"json_object\"}: "
                   "any JSON object, or {\"type\": \"json_schema\", \"json_schema\": "
                   "{\"name\", \"schema\"}}: an instance of the schema; generated token by "
                   "token within it")


class StreamOptions(Strict):
    include_usage: StrictBool = Field(False, description="a last chunk with the usage")


class OpenAISampling(Strict):
    """What OpenAI's chat and text completion requests share: sampling as /v1/generate's,
    OpenAI's default temperature, and the fields its clients send that change nothing
    here."""

    model: StrictStr | None = Field(None, description="accepted for OpenAI's clients; the "
                                                      "server answers with its one model")
    temperature: Annotated[Number, Field(ge=0, le=100, allow_inf_nan=False)] = Field(
        1.0, description="OpenAI's default, 1: sampling; 0: greedy")
    top_p: Annotated[Number, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0
    min_p: MinP = Field(0, description=MIN_P)
    repetition_penalty: Annotated[Number, Field(gt=0, le=100, allow_inf_nan=False)] = 1.0
    seed: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[Text, Field(min_length=1)] | Annotated[
        list[Annotated[Text, Field(min_length=1)]], Field(max_length=16)] | None = None
    frequency_penalty: Penalty = Field(0, description=FREQUENCY)
    presence_penalty: Penalty = Field(0, description=PRESENCE)
    logit_bias: LogitBias = Field(None, description=BIAS)
    user: StrictStr | None = Field(None, description="accepted and ignored")
    stream: StrictBool = Field(False, description="server-sent chunks as OpenAI's")
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = Field(None, description=RESPONSE_FORMAT)

    def reply_schema(self) -> dict[str, Any] | bool | None:
        """The schema replies must follow (None: free text)."""
        found = self.response_format
        if found is None or found.type == "text":
            return None
        return {"type": "object"} if found.type == "json_object" \
            else found.json_schema.schema_


class ChatRequest(OpenAISampling):
    """OpenAI's chat completion request, for its clients."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="reply tokens at most (default: what the context leaves)")
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="the same, OpenAI's newer name")
    n: Annotated[StrictInt, Field(ge=1, le=MAX_BEAM)] = Field(
        1, description="replies to the conversation, each drawn from a seed of its own")
    logprobs: StrictBool = Field(False, description="each reply token's log-probability")
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = Field(
        None, description="with logprobs: the likeliest this many tokens in each place")
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32)] | None = Field(
        None, description="variables of the model's chat template, as vLLM takes them and "
                          "transformers' apply_chat_template (Qwen3's "
                          "{\"enable_thinking\": false})")
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = Field(
        None, description="functions the model may call, for its chat template; its calls "
                          "come back as the message's tool_calls")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="with tools: \"auto\" (the default: the model decides), "
                          "\"none\" (the model is not shown the tools), \"required\" "
                          "(one call or more) or a function (one call of it): a forced "
                          "reply is generated within the form of the template's calls")
    parallel_tool_calls: StrictBool = Field(True, description="false: one call at most, "
                                                               "the reply's first")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] = Field(description="the token's text as UTF-8")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """OpenAI's: per token of the reply's content, in order (the end token is not
    content)."""

    content: list[TokenLogprob]
    refusal: None = None


class ReplyFunction(BaseModel):
    name: str
    arguments: str = Field(description="the arguments the model wrote, as a JSON object's "
                                       "text")


class ReplyToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ReplyFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="the answer; null where the reply is tool "
                                            "calls alone")
    reasoning_content: str | None = Field(
        None, description="a thinking model's reasoning (what it wrote between <think> and "
                          "</think>), apart from its answer; null for other models, or "
                          "where it did not reason")
    tool_calls: list[ReplyToolCall] = Field(
        default_factory=list, description="the functions the reply calls, given tools: "
                                          "its calls, apart from its text")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings


class OpenAIError(BaseModel):
    message: str
    type: Literal["invalid_request_error", "rate_limit_error"]
    param: str | None = Field(description="the field at fault, as a JSON path")
    code: None = None


class OpenAIErrorBody(BaseModel):
    """How the OpenAI-shaped routes (/v1/chat/completions, /v1/completions,
    /v1/embeddings) answer a request they refuse: as OpenAI does, for its clients to show
    the message."""

    error: OpenAIError


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
INPUT_SHAPES = "a text, a list of texts, token ids, or a list of lists of token ids"


def _input_shape(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """An input (OpenAI's prompt, or an embeddings input) of none of the four shapes,
    refused saying where it strays from them (a text's own fault, a lone surrogate, is
    named by the text's check)."""
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, str) or (isinstance(value, list) and value and
                                      all(isinstance(item, str) for item in value)):
            raise
        raise PydanticCustomError("input_shape", _input_problem(value)) from None


def _input_problem(value: Any) -> str:
    if not isinstance(value, list) or not value:
        return f"give {INPUT_SHAPES}, not {json.dumps(value)[:40]}"
    rows = value if isinstance(value[0], list) else [value]
    for i, row in enumerate(rows):
        where = f"[{i}]" if rows is value else ""
        if not isinstance(row, list) or not row:
            return f"item {where or 0} is {json.dumps(row)[:40]}: each item's ids are a " \
                   f"list of one or more"
        for j, token in enumerate(row):
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                return f"item {where}[{j}] is {json.dumps(token)[:40]}, no token id (an " \
                       f"integer from 0); give {INPUT_SHAPES}"
    return f"give {INPUT_SHAPES}"


TextsOrIds = Annotated[
    Text | Annotated[list[Text], Field(min_length=1)] | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)], WrapValidator(_input_shape)]


class CompletionRequest(OpenAISampling):
    """OpenAI's (legacy) completion request: prompts continued as they are, for its
    clients and the evaluation harnesses that score with `echo` and `logprobs`."""

    prompt: TextsOrIds = Field(description=(
        "a text, texts, a prompt's token ids, or several prompts' (ids are read as they "
        "are: no bos is added)"))
    max_tokens: Annotated[StrictInt, Field(ge=0)] = Field(
        16, description="tokens at most per completion (OpenAI's default, 16); 0 with "
                        "echo scores the prompt alone")
    n: Annotated[StrictInt, Field(ge=1, le=MAX_BEAM)] = Field(
        1, description="completions per prompt, each drawn from a seed of its own")
    best_of: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="only n: each completion drawn is returned")
    echo: StrictBool = Field(False, description="the prompt before its completion, and "
                                                "its tokens in logprobs")
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = Field(
        None, description="each token's log-probability and the likeliest this many "
                          "tokens in its place (the token's own is always among them)")
    suffix: None = Field(None, description="only null: no text after the completion")


class CompletionLogprobs(BaseModel):
    """OpenAI's: per token of the choice's text, in order."""

    tokens: list[str] = Field(description="each token's piece of the text (an end "
                                          "token's name, after the text)")
    token_logprobs: list[float | None] = Field(description="natural log-probability given "
                                                            "the tokens before (null: a "
                                                            "first token)")
    top_logprobs: list[dict[str, float] | None] = Field(description="the likeliest tokens "
                                                                    "in that place")
    text_offset: list[int] = Field(description="where each token's piece begins in the text")


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings


class EmbeddingsRequest(Strict):
    """OpenAI's embeddings request, for its client and the libraries built on it: the
    model's sentence embeddings, pooled and normalised as its checkpoint records."""

    input: TextsOrIds = Field(description=(
        "a text, texts, a text's token ids, or several texts' (ids are read as they are: "
        "no [CLS] or [SEP] is added)"))
    model: StrictStr | None = Field(None, description="accepted for OpenAI's clients; the "
                                                      "server answers with its one model")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's float32 values, little-endian, in "
                             "base64 (what OpenAI's client asks for)")
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="only the model's width: its vectors were not trained to be cut")
    user: StrictStr | None = Field(None, description="accepted and ignored")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="the vector, or its base64")


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int = Field(description="the tokens the model read, [CLS] and [SEP] "
                                           "counted")
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage
    timings: Timings


class RerankText(Strict):
    text: Text


class RerankRequest(Strict):
    """Cohere's and Jina's rerank request, for their clients and the frameworks' rerankers
    built on them."""

    query: Text = Field(examples=["Who wept?"])
    documents: Annotated[list[Text | RerankText], Field(min_length=1)] = Field(
        description="texts, or objects with a text")
    top_n: Annotated[StrictInt, Field(ge=1)] | None = Field(
        None, description="the most relevant this many (default: all)")
    return_documents: StrictBool = Field(True, description="each result with its text")
    model: StrictStr | None = Field(None, description="accepted for the clients; the server "
                                                      "answers with its one model")


class RerankResult(BaseModel):
    index: int = Field(description="the document's place in the request")
    relevance_score: float = Field(description="the sigmoid of the model's logit, in (0, 1)")
    document: RerankText | None = None


class RerankUsage(BaseModel):
    total_tokens: int = Field(description="the tokens the model read, the query's in each "
                                          "pair and the markers counted")


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult] = Field(description="the most relevant first")
    usage: RerankUsage
    timings: Timings
