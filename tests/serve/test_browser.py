"""The page in a real browser: Debian's Chromium, headless, driven by Playwright.

Types a sentence, translates, switches kind, layer and head, hovers tokens, and checks
what the page shows against the API; a long sentence (100+ pieces) loads its layers
lazily. Also the generate page (server-sent events, and the attention of a greedy
continuation), an instruct model's chat, the classify page (and the attention of a
pair), a cross-encoder's rerank page, a tagger's and a question answerer's.
Screenshots
go to the test's temporary directory.
"""

import copy
import math
import shutil

import httpx
import pytest
import torch

from tests.serve.conftest import SENTENCES
from tests.serve.test_server import ServerThread
from transduce.decode.translate import Translator
from transduce.config import preset
from transduce.data.tokenizer import Tokenizer
from transduce.model import Transformer
from transduce.serve import create_app
from transduce.serve.limits import Limits

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(shutil.which(CHROMIUM) is None,
                                reason="Debian's chromium is not installed "
                                       "(scripts/install-system-packages.sh installs it)")


@pytest.fixture(scope="module")
def chromium():
    """One Chromium for this file's tests (starting it takes about 1.5 s)."""
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture()
def browser_page(chromium):
    """A page of a fresh browser context (its own cookies, storage and cache, as a new
    profile's); fails the test on any script error."""
    errors: list[str] = []
    context = chromium.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        yield page
    finally:
        context.close()
    assert not errors, errors


def test_translate_and_explore_the_attention(browser_page, translator, tmp_path):
    page = browser_page
    with ServerThread(create_app(translator, name="tiny")) as server:
        page.goto(server.url + "/")
        page.fill("#source", "el gato rojo come")
        page.click("#translate")
        page.wait_for_function("document.getElementById('output').textContent.length > 0")
        expected = httpx.post(server.url + "/v1/attention",
                              json={"text": "el gato rojo come", "layers": [1]}).json()
        assert page.text_content("#output") == expected["translation"]
        assert page.locator("#layer option").all_text_contents() == ["1", "2"]
        assert page.locator("#head option").all_text_contents() == ["all heads", "1", "2", "3", "4"]
        assert page.locator("#rows .tok").all_text_contents() == expected["target_outputs"]
        assert page.locator("#columns .tok").all_text_contents() == expected["source_tokens"]

        page.select_option("#layer", "2")
        page.select_option("#head", "3")
        page.wait_for_function("state.maps[2] !== undefined")     # fetched when chosen
        row = page.locator("#rows .tok").nth(1)
        row.hover()
        assert "active" in row.get_attribute("class")
        target = expected["target_outputs"][1]
        assert page.text_content("#cell").startswith(f"{target} attends most to ")
        layer2 = httpx.post(server.url + "/v1/attention", json={
            "text": "el gato rojo come", "layers": [2], "kinds": ["cross"]}).json()
        weights = layer2["maps"]["cross"]["2"][2][1]
        best = max(range(len(weights)), key=weights.__getitem__)
        assert page.text_content("#cell").endswith(f"({weights[best]:.3f})")

        page.click(".segmented button[data-kind=encoder]")
        page.locator("#rows .tok").nth(2).hover()
        assert page.locator("#rows .tok.active").count() == 1
        assert page.locator("#columns .tok.active").count() == 1   # a token is both axes
        canvas = page.locator("#map").bounding_box()
        tokens = len(expected["source_tokens"])
        assert abs(canvas["width"] - canvas["height"]) <= 2 and canvas["width"] >= 5 * tokens

        page.select_option("#head", "all")
        assert page.locator("#grid figure").count() == 4 and page.is_hidden("#single")
        assert page.locator("#alignment line").count() == len(expected["target_outputs"])
        # each line joins the centres of its two tokens
        offsets = page.evaluate("""() => [...document.querySelectorAll('#alignment line')].map(
            (line) => {
                const source = document.querySelector('#align-source')
                    .children[line.dataset.source];
                const target = document.querySelector('#align-target')
                    .children[line.dataset.target];
                const box = document.querySelector('#alignment').getBoundingClientRect();
                const middle = (e) => e.getBoundingClientRect().left - box.left
                                      + e.getBoundingClientRect().width / 2;
                return [line.x1.baseVal.value - middle(source),
                        line.x2.baseVal.value - middle(target)];
            })""")
        assert all(abs(a) < 1.5 and abs(b) < 1.5 for a, b in offsets), offsets
        page.locator("#grid figure").nth(1).click()
        assert page.input_value("#head") == "2" and page.is_visible("#single")
        shot = tmp_path / "explorer.png"
        page.screenshot(path=str(shot), full_page=True)
        # a rollout runs through a stack: cross-attention and the alignment go
        page.click(".segmented button[data-kind=cross]")
        page.check("#rollout")
        page.wait_for_function("state.meta.rollout && state.kind === 'encoder'")
        assert page.is_disabled(".segmented button[data-kind=cross]")
        assert page.is_hidden("#alignment-part") and page.is_hidden("#head-choice")
        page.uncheck("#rollout")
        page.wait_for_function("!state.meta.rollout")
        assert page.is_enabled(".segmented button[data-kind=cross]")
    assert shot.stat().st_size > 10_000


def test_the_no_doubles_box_starts_as_the_server_s_default_and_is_sent(browser_page,
                                                                        translator):
    page = browser_page
    text = next(text for text in SENTENCES if translator.translate([text])
                != translator.translate([text], no_doubles=True))
    kept, free = (translator.translate([text], no_doubles=flag)[0] for flag in (True, False))
    app = create_app(translator, name="tiny", limits=Limits(no_doubles=True))
    with ServerThread(app) as server:
        page.goto(server.url + "/")
        page.wait_for_function("document.getElementById('no-doubles').checked")
        page.fill("#source", text)
        for checked, expected in ((True, kept), (False, free)):
            page.set_checked("#no-doubles", checked)
            page.evaluate("document.getElementById('output').textContent = ''")
            page.click("#translate")
            page.wait_for_function("document.getElementById('output').textContent.length > 0")
            assert page.text_content("#output") == expected


def test_a_long_sentence_loads_one_layer_at_a_time(browser_page, tiny_corpus):
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=300, tgt_vocab_size=300,
                               max_positions=256))
    translator = Translator(model, Tokenizer(tiny_corpus / "spm.model"))
    sentence = " ".join(["el perro grande come", "gato rojo", "casa tres"] * 8)
    pieces = len(translator.tokenizer.encode([sentence])[0])
    assert pieces >= 100
    page = browser_page
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.post_data or "") if "attention" in r.url else None)
    with ServerThread(create_app(translator)) as server:
        page.goto(server.url + "/")
        page.fill("#source", sentence)
        page.select_option("#beam", "1")
        page.click("#translate")
        page.wait_for_function("document.getElementById('output').textContent.length > 0",
                               timeout=60_000)
        assert page.locator("#columns .tok").count() == pieces + 1        # eos
        assert len(asked) == 1 and '"layers":[1]' in asked[0]
        page.select_option("#layer", "2")
        page.wait_for_function("document.getElementById('cell').textContent === ''")
        assert len(asked) == 2 and '"layers":[2]' in asked[1]
        page.select_option("#layer", "1")                                   # kept
        assert len(asked) == 2
        width = page.locator("#map").bounding_box()["width"]
        assert width <= 800


def test_an_onnx_export_translates_without_the_explorer(browser_page, translation_dir,
                                                         translator, tmp_path):
    """A model without attention maps (an ONNX export): the page translates through
    /v1/translate, says why there is no explorer, and shows none."""
    pytest.importorskip("onnxruntime")
    from transduce import load
    from transduce.export.onnx import export_onnx

    page = browser_page
    engine = load(export_onnx(translation_dir, tmp_path / "onnx"))
    with ServerThread(create_app(engine, name="tiny-onnx")) as server:
        page.goto(server.url + "/")
        page.wait_for_function("document.getElementById('model-info').textContent.length > 0")
        page.fill("#source", "el gato rojo come")
        page.click("#translate")
        page.wait_for_function("document.getElementById('output').textContent.length > 0")
        assert page.text_content("#output") == translator.translate(["el gato rojo come"])[0]
        assert page.text_content("#status").endswith("this model serves no attention maps")
        assert page.is_hidden("#explorer")


def test_generate_page_streams_the_continuation(browser_page, generator):
    page = browser_page
    with ServerThread(create_app(generator)) as server:
        page.goto(server.url + "/")
        # The page shows the loaded model's panel once it has read /v1/models.
        page.wait_for_selector("#generate-panel", state="visible", timeout=30_000)
        assert page.is_hidden("#translate-panel")
        page.fill("#prompt", "uno dos")
        page.fill("#max-new", "12")
        page.click("#generate")
        page.wait_for_function("/ms$/.test(document.getElementById('gen-status').textContent)")
    assert page.text_content("#continuation") == generator.generate(["uno dos"],
                                                                    max_new_tokens=12)[0]


def test_generate_page_explores_the_attention_of_a_greedy_continuation(browser_page,
                                                                       generator):
    """The Attention button: the continuation's causal self-attention, a layer at a time,
    its axes the pieces each position reads and is followed by; its rollout; Generate
    hides it."""
    page = browser_page
    with ServerThread(create_app(generator)) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("#generate-attention", state="visible", timeout=30_000)
        page.fill("#prompt", "uno dos")
        page.fill("#max-new", "5")
        page.click("#generate-attention")
        page.wait_for_selector("#explorer", state="visible")
        expected = httpx.post(server.url + "/v1/attention", json={
            "prompt": "uno dos", "max_new_tokens": 5, "layers": [2]}).json()
        assert page.text_content("#continuation") == expected["continuation"]
        assert page.text_content("#explorer-text") == "uno dos" + expected["continuation"]
        assert page.text_content("#explorer-title").startswith("Self-attention")
        assert page.is_hidden(".segmented") and page.is_hidden("#alignment-part")
        assert page.locator("#rows .tok").all_text_contents() == expected["outputs"]
        assert page.locator("#columns .tok").all_text_contents() == expected["inputs"]
        page.select_option("#layer", "2")
        page.select_option("#head", "2")
        page.wait_for_function("state.maps[2] !== undefined")
        row = page.locator("#rows .tok").nth(3)
        row.hover()
        weights = expected["maps"]["decoder"]["2"][1][3]
        best = max(range(len(weights)), key=weights.__getitem__)
        assert best <= 3                                     # causal: up to its own place
        assert page.text_content("#cell") == (f"{expected['outputs'][3]} attends most to "
                                              f"{expected['inputs'][best]} "
                                              f"({weights[best]:.3f})")
        page.check("#rollout")                   # one map a layer: no head to choose
        page.wait_for_function("state.meta.rollout && state.maps[2] !== undefined")
        assert page.is_hidden("#head-choice")
        rolled = httpx.post(server.url + "/v1/attention", json={
            "prompt": "uno dos", "max_new_tokens": 5, "layers": [2], "rollout": True,
            "decimals": 3}).json()["maps"]["decoder"]["2"][0][3]
        page.locator("#rows .tok").nth(3).hover()
        best = max(range(len(rolled)), key=rolled.__getitem__)
        assert page.text_content("#cell").endswith(f"attends most to {expected['inputs'][best]} "
                                                   f"({rolled[best]:.3f})")
        page.click("#generate")
        assert page.is_hidden("#explorer")


def test_an_instruct_model_holds_a_conversation_on_the_page(browser_page, chatml, tmp_path):
    """Two messages, each answered (streamed) with the history before it, as
    Generator.chat answers the same conversation; "New chat" forgets it."""
    page, generator = browser_page, chatml.generator
    with ServerThread(create_app(generator)) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("#chat-panel", state="visible", timeout=30_000)
        page.fill("#chat-max", "12")
        conversation = [{"role": "system", "content": "Answer in Spanish."}]
        page.fill("#system", conversation[0]["content"])
        for number, text in enumerate(["Hello world!", "In the beginning"], start=1):
            page.fill("#message", text)
            page.click("#send")
            page.wait_for_function(f"document.querySelectorAll('#messages li').length == "
                                   f"{2 * number} && /tokens$/.test("
                                   f"document.getElementById('chat-status').textContent)")
            conversation.append({"role": "user", "content": text})
            reply = generator.chat(conversation, max_new_tokens=12)
            assert page.text_content("#messages li.assistant:last-child") == reply
            conversation.append({"role": "assistant", "content": reply})
        page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
        page.click("#new-chat")
        assert page.locator("#messages li").count() == 0


def test_a_thinking_models_reasoning_shows_apart_from_its_answer(browser_page, reasoning):
    """The reasoning streams into its own block above the answer, and goes back with the
    answer in the next message's history. (Each request gets the fixture's bias towards
    </think>, added on its way, so that the random model closes its reasoning.)"""
    import json

    page, sent = browser_page, []

    def biased(route):
        body = {**route.request.post_data_json, "logit_bias": reasoning.bias}
        sent.append(body)
        route.continue_(post_data=json.dumps(body))
    thought, _, answer = reasoning.text.partition("</think>")
    with ServerThread(create_app(reasoning.generator)) as server:
        page.route("**/v1/chat/completions", biased)
        page.goto(server.url + "/")
        page.wait_for_selector("#chat-panel", state="visible", timeout=30_000)
        page.fill("#chat-max", "24")
        page.fill("#chat-temperature", "0")
        page.fill("#system", "Answer in Spanish.")
        for number in (1, 2):
            page.fill("#message", "In the beginning")
            page.click("#send")
            page.wait_for_function(f"document.querySelectorAll('#messages li').length == "
                                   f"{2 * number} && /tokens$/.test("
                                   f"document.getElementById('chat-status').textContent)")
        first = page.locator("#messages li.assistant").first
        assert first.locator(".thought").text_content() == thought.strip("\n")
        assert first.locator(".thought").is_visible()
        assert first.locator("span").text_content() == answer.lstrip("\n")
    assert sent[1]["messages"][2] == {"role": "assistant", "content": answer.lstrip("\n"),
                                      "reasoning_content": thought.strip("\n")}


def test_a_model_without_a_template_shows_no_chat(browser_page, generator):
    page = browser_page
    with ServerThread(create_app(generator)) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("#generate-panel", state="visible", timeout=30_000)
        page.wait_for_function("document.getElementById('model-info').textContent")
        assert page.is_hidden("#chat-panel")


def test_encoder_page_classifies(browser_page, encoder):
    page = browser_page
    with ServerThread(create_app(encoder)) as server:
        page.goto(server.url + "/")
        page.fill("#lines", "uno dos\nel perro")
        page.click("#classify")
        page.wait_for_selector("#enc-output tr")
        assert page.is_hidden("#rerank") and page.is_hidden("#query")
    labels = [p.label for p in encoder.classify(["uno dos", "el perro"])]
    cells = page.locator("#enc-output tr td:nth-child(2)").all_text_contents()
    assert [cell.split(" ")[0] for cell in cells] == labels


def test_encoder_page_reranks_with_a_cross_encoder(browser_page, reranker):
    """A model of one output (/v1/models: "reranks"): the page asks for a query, ranks
    the lines by it as the library does, and offers no classification."""
    page, documents = browser_page, ["uno dos", "el perro", "gato rojo"]
    with ServerThread(create_app(reranker)) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("#query", state="visible")
        assert page.is_hidden("#classify")
        page.fill("#lines", "\n".join(documents))
        page.click("#rerank")
        page.wait_for_function(
            "/type a query first/.test(document.getElementById('enc-status').textContent)")
        page.fill("#query", "el perro grande")
        page.click("#rerank")
        page.wait_for_selector("#enc-output tr")
    expected = reranker.rerank("el perro grande", documents)
    cells = page.locator("#enc-output tr td").all_text_contents()
    assert cells[0::2] == [documents[r.index] for r in expected]
    assert cells[1::2] == [f"{r.relevance:.3f}" for r in expected]


def test_encoder_page_tags_with_a_token_classifier(browser_page, tagger):
    """/v1/models says "tags": the page tags each line's words as the library does, and
    lists its entities; it offers no classification."""
    page, lines = browser_page, ["uno dos el perro", "gato rojo grande come"]
    with ServerThread(create_app(tagger)) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("#tag", state="visible")
        assert page.is_hidden("#classify") and page.is_hidden("#answer")
        page.fill("#lines", "\n".join(lines))
        page.click("#tag")
        page.wait_for_selector("#enc-output tr")
    expected = tagger.tag(lines)
    cells = page.locator("#enc-output tr td").all_text_contents()
    assert cells[1::3] == [" ".join(f"{w.word}/{w.tag}" for w in line) for line in expected]


def test_encoder_page_answers_with_a_question_answerer(browser_page, answerer):
    """/v1/models says "answers": the page asks for a question and answers it from each
    line as the library does."""
    page, contexts = browser_page, ["uno dos el perro", "gato rojo grande come"]
    with ServerThread(create_app(answerer)) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("#question", state="visible")
        assert page.is_hidden("#classify") and page.is_hidden("#tag")
        page.fill("#lines", "\n".join(contexts))
        page.click("#answer")
        page.wait_for_function(
            "/type a question first/.test(document.getElementById('enc-status').textContent)")
        page.fill("#question", "el perro")
        page.click("#answer")
        page.wait_for_selector("#enc-output tr")
    expected = answerer.answer(["el perro"] * 2, contexts)
    cells = page.locator("#enc-output tr td").all_text_contents()
    assert cells[1::2] == [f"{a[0].text} ({a[0].score:.3f})" for a in expected]
    spans = answerer._span_logits

    def cls_first(ids, segments):        # [CLS] scores far above the spans: no answer
        logits = spans(ids, segments).clone()
        logits[:, 0] += 20.0
        return logits

    answerer._span_logits = cls_first
    try:
        with ServerThread(create_app(answerer)) as server:
            page.goto(server.url + "/")
            page.wait_for_selector("#question", state="visible")
            page.fill("#lines", "\n".join(contexts))
            page.fill("#question", "el perro")
            page.check("#no-answer")
            page.click("#answer")
            page.wait_for_selector("#enc-output tr")
        abstained = answerer.answer(["el perro"] * 2, contexts, no_answer=True)
    finally:
        del answerer._span_logits
    assert all(not answers[0].text for answers in abstained)
    cells = page.locator("#enc-output tr td").all_text_contents()
    assert cells[1::2] == [f"(no answer {a[0].score:.3f})" for a in abstained]


@pytest.fixture()
def pairs_encoder(encoder):
    """The encoder as a classifier fine-tuned on pairs (/v1/models says so)."""
    pairs_encoder = copy.copy(encoder)
    pairs_encoder.classifier_inputs = "pairs"
    return pairs_encoder


def test_encoder_page_classifies_pairs(browser_page, pairs_encoder):
    """A classifier of pairs: the page asks for each line's second text, and checks
    that every line has one before it sends them."""
    page = browser_page
    with ServerThread(create_app(pairs_encoder)) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("#seconds", state="visible")
        page.fill("#lines", "uno dos\nel perro")
        page.fill("#seconds", "el perro")
        page.click("#classify")
        page.wait_for_function(
            "/2 texts but 1 second texts/.test(document.getElementById('enc-status').textContent)")
        page.fill("#seconds", "el perro\nuno")
        page.click("#classify")
        page.wait_for_selector("#enc-output tr")
    labels = [p.label for p in pairs_encoder.classify(["uno dos", "el perro"],
                                                      pairs=["el perro", "uno"])]
    cells = page.locator("#enc-output tr td").all_text_contents()
    assert cells[0::2] == ["uno dos | el perro", "el perro | uno"]
    assert [cell.split(" ")[0] for cell in cells[1::2]] == labels


def test_encoder_page_explores_the_attention_of_a_pair(browser_page, pairs_encoder):
    """The Attention button of a classifier of pairs: the first line and its second
    text, [CLS] text [SEP] second [SEP] on both axes."""
    page = browser_page
    with ServerThread(create_app(pairs_encoder)) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("#seconds", state="visible")
        page.fill("#lines", "uno dos\nel perro")
        page.fill("#seconds", "el gato")
        page.click("#encoder-attention")
        page.wait_for_selector("#explorer", state="visible")
        expected = httpx.post(server.url + "/v1/attention", json={
            "text": "uno dos", "text_pair": "el gato", "layers": [1]}).json()
        assert page.text_content("#explorer-text") == "uno dos | el gato"
        assert page.locator("#rows .tok").all_text_contents() == expected["tokens"]
        assert page.locator("#columns .tok").all_text_contents() == expected["tokens"]
        page.locator("#rows .tok").nth(1).hover()
        assert page.locator("#columns .tok.active").count() == 1   # a token is both axes
        page.select_option("#head", "all")
        assert page.locator("#grid figure").count() == expected["heads"]
        assert page.is_hidden("#alignment-part")
        # each head's caption: the mean entropy of its rows, in nats
        captions = page.locator("#grid figcaption").all_text_contents()
        for caption, head in zip(captions, expected["maps"]["encoder"]["1"]):
            entropy = sum(-sum(p * math.log(p) for p in row if p > 0) for row in head) / \
                len(head)
            assert caption.startswith("head ") and caption.endswith(" nats")
            assert float(caption.split(" · ")[1].split()[0]) == pytest.approx(entropy,
                                                                              abs=0.006)


def test_the_api_docs_render_with_no_network(browser_page, generator):
    """Swagger UI draws the API from the server's own files, and stays on the page a
    while: every request that would leave the server is refused and counted."""
    page = browser_page
    elsewhere: list[str] = []
    with ServerThread(create_app(generator)) as server:
        def only_the_server(route):
            if route.request.url.startswith(server.url):
                return route.continue_()
            elsewhere.append(route.request.url)
            return route.abort()

        page.route("**/*", only_the_server)
        page.goto(server.url + "/docs")
        page.wait_for_selector(".opblock-summary-path", timeout=30_000)
        paths = page.locator(".opblock-summary-path").all_text_contents()
        assert {"/v1/generate", "/health", "/v1/models"} <= {p.replace("\u200b", "")
                                                              for p in paths}
        page.get_by_text("/v1/generate").first.click()         # an operation opened
        page.wait_for_selector(".opblock-body", timeout=30_000)
        page.wait_for_timeout(1000)
    assert elsewhere == []


def test_a_multilingual_model_translates_into_the_language_picked(browser_page, tmp_path):
    pytest.importorskip("transformers")
    from tests.test_import_nllb import write_nllb
    from transduce.importers import import_nllb

    directory, _ = write_nllb(tmp_path / "hf")
    translator = Translator.load(import_nllb(directory, tmp_path / "nllb"))
    page = browser_page
    with ServerThread(create_app(translator, name="nllb")) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("#languages:not([hidden])")
        assert page.input_value("#source-lang") == "eng_Latn"     # the pair it records
        assert page.input_value("#target-lang") == "spa_Latn"
        assert page.locator("#target-lang option").all_text_contents() == \
            ["eng_Latn", "fra_Latn", "spa_Latn"]
        page.select_option("#target-lang", "fra_Latn")
        page.fill("#source", "sea shells by the shore")
        page.click("#translate")
        page.wait_for_function("document.getElementById('status').textContent"
                               ".includes('log-probability')")
        expected = httpx.post(server.url + "/v1/attention", json={
            "text": "sea shells by the shore", "layers": [1], "target_lang": "fra_Latn"}).json()
        assert expected["translation"]
        assert page.text_content("#output") == expected["translation"]
        assert page.locator("#rows .tok").all_text_contents() == expected["target_outputs"]
        assert expected["target_outputs"][0] == "\u2581fra_Latn"
