// The page of `transduce serve`: a translate box (or, for other kinds of model, a
// generate box, with a chat for an instruct model, or a classify / tag / answer / rerank
// / embed box, as the encoder's head allows), and an attention explorer of a translation,
// of an encoder's pass over a text, or of a greedy continuation. No libraries, no network
// beyond this server: the maps are drawn on canvases, one layer fetched at a time.
"use strict";

const $ = (id) => document.getElementById(id);
const KIND = document.body.dataset.kind;
const state = { meta: null, maps: {}, kind: "cross", layer: 1, head: "1", hover: null,
                request: null, attentionMaps: true, pairs: false };

async function api(path, body) {
  const response = await fetch(path, { method: "POST", body: JSON.stringify(body),
                                       headers: { "content-type": "application/json" } });
  const data = await response.json().catch(() => ({ error: response.statusText }));
  if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
  return data;
}

function setStatus(id, text, isError = false) {
  const element = $(id);
  element.textContent = text;
  element.classList.toggle("error", isError);
}

// ---------------------------------------------------------------- translation + explorer

async function translate() {
  const text = $("source").value.trim();
  if (!text) return setStatus("status", "type a sentence first", true);
  const button = $("translate");
  button.disabled = true;
  setStatus("status", "translating…");
  const started = performance.now();
  try {
    if (!state.attentionMaps) return await translateOnly(text, started);
    const data = await explore({ text, beam: Number($("beam").value), decimals: 3,
                                 no_doubles: $("no-doubles").checked, ...chosenLanguages() });
    $("output").textContent = data.translation;
    $("output").classList.add("done");
    setStatus("status", `${Math.round(performance.now() - started)} ms · log-probability ` +
                        `${data.log_prob.toFixed(3)}`);
  } catch (error) {
    $("output").textContent = "";
    setStatus("status", error.message, true);
  } finally {
    button.disabled = false;
  }
}

// A model without attention maps (an ONNX export): the translation alone.
async function translateOnly(text, started) {
  const data = await api("/v1/translate", { texts: [text], beam: Number($("beam").value),
                                            no_doubles: $("no-doubles").checked,
                                            ...chosenLanguages() });
  const found = data.translations[0];
  $("output").textContent = found.text;
  $("output").classList.add("done");
  $("explorer").hidden = true;
  setStatus("status", `${Math.round(performance.now() - started)} ms · score ` +
                      `${found.score.toFixed(3)} · this model serves no attention maps`);
}

// A multilingual model's languages, picked on the page (empty for a model of one pair).
function chosenLanguages() {
  if ($("languages").hidden) return {};
  return { source_lang: $("source-lang").value, target_lang: $("target-lang").value };
}

function setUpLanguages(codes, languages) {
  fillSelect($("source-lang"), codes, languages?.source ?? codes[0]);
  fillSelect($("target-lang"), codes, languages?.target ?? codes[Math.min(1, codes.length - 1)]);
  $("languages").hidden = false;
}

// The maps of a request to /v1/attention (a translation's, a text's or a prompt's), its
// first layer fetched and drawn; the answer, for the caller to show the text.
async function explore(request) {
  const asked = { ...request, rollout: $("rollout").checked };
  const data = await api("/v1/attention", { ...asked, layers: [1] });
  state.request = asked;
  state.meta = explorerMeta(data, asked.rollout);
  state.maps = { 1: data.maps };
  setUpExplorer();
  return data;
}

// The rollout box: the same text's maps again, rolled out or not.
async function toggleRollout() {
  if (!state.request) return;
  setStatus("cell", "loading…");
  try {
    await explore(state.request);
    setStatus("cell", "");
  } catch (error) {
    setStatus("cell", error.message, true);
  }
}

// An answer of any shape as the explorer reads it: the layers of each kind (0 where the
// model has none; a rollout's none of cross-attention) and the pieces on the axes
// (translation's names).
function explorerMeta(data, rollout) {
  const layers = { encoder: 0, decoder: 0, cross: 0, ...data.layers };
  if (rollout) layers.cross = 0;
  return { layers, heads: data.heads, rollout,
           source_tokens: data.source_tokens ?? data.tokens ?? [],
           target_inputs: data.target_inputs ?? data.inputs ?? [],
           target_outputs: data.target_outputs ?? data.outputs ?? [] };
}

function setUpExplorer() {
  const meta = state.meta;
  for (const button of document.querySelectorAll(".segmented button")) {
    button.disabled = meta.layers[button.dataset.kind] === 0;
  }
  $("explorer").querySelector(".segmented").hidden = KIND !== "translation";
  // (an RNN's attention is cross-attention alone: no stack to roll out through)
  $("rollout").parentElement.hidden = meta.layers.encoder + meta.layers.decoder === 0;
  $("alignment-part").hidden = meta.layers.cross === 0;
  if (meta.layers[state.kind] === 0) {
    state.kind = ["cross", "encoder", "decoder"].find((kind) => meta.layers[kind] > 0);
  }
  fillSelect($("layer"), range(1, meta.layers[state.kind]).map(String), String(state.layer));
  fillSelect($("head"), ["all", ...range(1, meta.heads).map(String)], state.head);
  if (meta.rollout) $("head").value = "1";        // one map a layer
  $("head-choice").hidden = meta.rollout;
  state.layer = Number($("layer").value);
  state.head = $("head").value;
  $("explorer").hidden = false;
  showLayer();
}

function range(first, last) {
  return Array.from({ length: Math.max(0, last - first + 1) }, (_, i) => first + i);
}

function fillSelect(select, values, wanted) {
  select.replaceChildren(...values.map((v) => new Option(v === "all" ? "all heads" : v, v)));
  select.value = values.includes(wanted) ? wanted : values[0];
}

async function showLayer() {
  const layer = state.layer;
  if (!state.maps[layer]) {
    setStatus("cell", `loading layer ${layer}…`);
    try {
      const data = await api("/v1/attention", { ...state.request, layers: [layer] });
      state.maps[layer] = data.maps;
    } catch (error) {
      return setStatus("cell", error.message, true);
    }
    setStatus("cell", "");
  }
  if (layer === state.layer) render();
}

function axes(kind) {
  const m = state.meta;
  if (kind === "encoder") return { rows: m.source_tokens, columns: m.source_tokens };
  if (kind === "decoder") return { rows: m.target_outputs, columns: m.target_inputs };
  return { rows: m.target_outputs, columns: m.source_tokens };
}

function currentMaps(kind = state.kind) {
  const layer = state.maps[state.layer] && state.maps[state.layer][kind];
  return layer ? layer[String(state.layer)] : undefined;
}

function render() {
  const heads = currentMaps();
  document.querySelectorAll(".segmented button").forEach((b) =>
    b.classList.toggle("on", b.dataset.kind === state.kind));
  if (!heads) return;
  const all = state.head === "all";
  $("single").hidden = all;
  $("grid").hidden = !all;
  if (all) renderGrid(heads); else renderSingle(heads[Number(state.head) - 1]);
  renderAlignment();
}

function cellSize(rows, columns, room = 760) {
  return Math.max(3, Math.min(22, Math.floor(room / Math.max(rows, columns))));
}

function renderSingle(matrix) {
  const { rows, columns } = axes(state.kind);
  const cell = cellSize(rows.length, columns.length);
  const box = $("single");
  box.style.setProperty("--cell", `${cell}px`);
  box.style.fontSize = `${Math.min(11, cell - 1)}px`;
  $("rows").replaceChildren(...rows.map((t, i) => token(t, "row", i)));
  $("columns").replaceChildren(...columns.map((t, j) => token(t, "column", j)));
  drawMap($("map"), matrix, cell, state.hover);
  highlightLabels();
}

function token(text, axis, index) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = text;
  span.title = text;
  span.dataset.axis = axis;
  span.dataset.index = index;
  span.addEventListener("mouseenter", () => hover({ [axis]: index }));
  span.addEventListener("mouseleave", () => hover(null));
  return span;
}

function hover(target) {
  // On a self-attention map a token is both a query row and a key column: show both.
  if (target && state.kind === "encoder") {
    const i = target.row ?? target.column;
    if (target.row === undefined || target.column === undefined) target = { row: i, column: i };
  }
  state.hover = target;
  const matrix = currentMaps()?.[Number(state.head) - 1];
  if (!matrix || state.head === "all") return;
  const cell = cellSize(matrix.length, matrix[0].length);
  drawMap($("map"), matrix, cell, target);
  highlightLabels();
  describeCell(matrix, target);
}

function describeCell(matrix, target) {
  const { rows, columns } = axes(state.kind);
  if (!target) return setStatus("cell", "");
  const { row, column } = target;
  if (row !== undefined && column !== undefined) {
    const weight = matrix[row][column].toFixed(3);
    return setStatus("cell", `${rows[row]} → ${columns[column]}: ${weight}`);
  }
  if (row !== undefined) {
    const best = argmax(matrix[row]);
    return setStatus("cell", `${rows[row]} attends most to ${columns[best]} ` +
                             `(${matrix[row][best].toFixed(3)})`);
  }
  const column_values = matrix.map((r) => r[column]);
  const best = argmax(column_values);
  setStatus("cell", `${columns[column]} is attended most by ${rows[best]} ` +
                    `(${column_values[best].toFixed(3)})`);
}

function argmax(values) {
  return values.reduce((best, v, i) => (v > values[best] ? i : best), 0);
}

function highlightLabels() {
  const h = state.hover || {};
  document.querySelectorAll("#single .tok").forEach((span) => {
    const index = Number(span.dataset.index);
    span.classList.toggle("active", h[span.dataset.axis] === index);
  });
}

// viridis, in five stops
const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

function color(value) {
  const x = Math.min(1, Math.max(0, value)) * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(x));
  const f = x - i;
  const c = STOPS[i].map((a, k) => Math.round(a + f * (STOPS[i + 1][k] - a)));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

function drawMap(canvas, matrix, cell, highlight) {
  const rows = matrix.length, columns = matrix[0].length;
  canvas.width = columns * cell;
  canvas.height = rows * cell;
  const g = canvas.getContext("2d");
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < columns; c++) {
      g.fillStyle = color(matrix[r][c]);
      g.fillRect(c * cell, r * cell, cell, cell);
    }
  }
  if (!highlight) return;
  g.strokeStyle = "#ff3b30";
  g.lineWidth = 2;
  if (highlight.row !== undefined) {
    g.strokeRect(1, highlight.row * cell + 1, canvas.width - 2, cell - 2);
  }
  if (highlight.column !== undefined) {
    g.strokeRect(highlight.column * cell + 1, 1, cell - 2, canvas.height - 2);
  }
}

function renderGrid(heads) {
  const { rows, columns } = axes(state.kind);
  const cell = Math.max(2, cellSize(rows.length, columns.length, 220));
  $("grid").replaceChildren(...heads.map((matrix, h) => {
    const figure = document.createElement("figure");
    const canvas = document.createElement("canvas");
    drawMap(canvas, matrix, cell, null);
    const caption = document.createElement("figcaption");
    caption.textContent = `head ${h + 1} · ${meanEntropy(matrix).toFixed(2)} nats`;
    caption.title = "the mean entropy of its rows: low where each query looks at few " +
                    "keys, up to ln(keys) where it spreads evenly";
    figure.append(canvas, caption);
    figure.addEventListener("click", () => {
      state.head = $("head").value = String(h + 1);
      render();
    });
    return figure;
  }));
}

// The mean over a map's rows of -sum p ln p (nats): how spread a head's attention is.
function meanEntropy(matrix) {
  const rows = matrix.map((row) => -row.reduce((sum, p) => sum + (p > 0 ? p * Math.log(p) : 0), 0));
  return rows.reduce((sum, h) => sum + h, 0) / rows.length;
}

function renderAlignment() {
  const heads = currentMaps("cross");
  const box = $("alignment");
  if (!heads) return box.replaceChildren();
  const m = state.meta;
  const targets = m.target_outputs, sources = m.source_tokens;
  const mean = targets.map((_, t) => sources.map((_, s) =>
    heads.reduce((sum, head) => sum + head[t][s], 0) / heads.length));
  const line = (tokens, id) => {
    const div = document.createElement("div");
    div.className = "line";
    div.id = id;
    div.replaceChildren(...tokens.map((t) => {
      const span = document.createElement("span");
      span.className = "tok";
      span.textContent = t;
      return span;
    }));
    return div;
  };
  const top = line(sources, "align-source"), bottom = line(targets, "align-target");
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("height", "60");
  box.replaceChildren(top, svg, bottom);
  const width = Math.max(top.scrollWidth, bottom.scrollWidth);
  svg.setAttribute("width", String(width));
  const center = (span) => span.offsetLeft + span.offsetWidth / 2;     // box: offsetParent
  targets.forEach((_, t) => {
    const s = argmax(mean[t]);
    const path = document.createElementNS("http://www.w3.org/2000/svg", "line");
    path.setAttribute("x1", center(top.children[s]));
    path.setAttribute("y1", "0");
    path.setAttribute("x2", center(bottom.children[t]));
    path.setAttribute("y2", "60");
    path.setAttribute("stroke", "#2f6fd0");
    path.setAttribute("stroke-width", String(1 + 3 * mean[t][s]));
    path.setAttribute("stroke-opacity", String(0.25 + 0.75 * mean[t][s]));
    path.dataset.target = t;
    path.dataset.source = s;
    svg.append(path);
  });
}

// ---------------------------------------------------------------- other kinds of model

async function generate() {
  const prompt = $("prompt").value;
  if (!prompt) return setStatus("gen-status", "type a prompt first", true);
  $("generate").disabled = true;
  $("explorer").hidden = true;           // its maps are of another continuation
  $("prompt-echo").textContent = prompt;
  $("continuation").textContent = "";
  setStatus("gen-status", "generating…");
  try {
    const response = await fetch("/v1/generate", { method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ prompts: [prompt], stream: true,
                             max_new_tokens: Number($("max-new").value),
                             temperature: Number($("temperature").value) }) });
    if (!response.ok) throw new Error((await response.json()).error);
    await eachEvent(response, onEvent);
  } catch (error) {
    setStatus("gen-status", error.message, true);
  } finally {
    $("generate").disabled = false;
  }
}

// Each server-sent event of a streamed answer, as its text block, in order.
async function eachEvent(response, onBlock) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      onBlock(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
    }
  }
}

// An instruct model's conversation: each message sent with the history before it, the
// reply streamed into the page; the history keeps only exchanges that were answered.
// A thinking model's reasoning (delta.reasoning_content) shows above its answer and
// goes back with it, for its template to keep or drop.
const chat = { history: [] };

function replyParts(item) {
  const thought = document.createElement("div"), answer = document.createElement("span");
  thought.className = "thought";
  thought.hidden = true;
  item.append(thought, answer);
  return { thought, answer };
}

function bubble(role, text) {
  const item = document.createElement("li");
  item.className = role;
  item.textContent = text;
  $("messages").append(item);
  return item;
}

async function send() {
  const text = $("message").value.trim();
  if (!text) return setStatus("chat-status", "type a message first", true);
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []),
                    ...chat.history, { role: "user", content: text }];
  const asked = bubble("user", text), reply = bubble("assistant", "");
  const parts = replyParts(reply);
  $("send").disabled = true;
  setStatus("chat-status", "replying…");
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ messages, stream: true, stream_options: { include_usage: true },
                             max_tokens: Number($("chat-max").value),
                             temperature: Number($("chat-temperature").value) }) });
    if (!response.ok) throw new Error((await response.json()).error.message);
    let usage = null;
    await eachEvent(response, (block) => {
      const data = /^data: (.*)$/m.exec(block)?.[1];
      if (!data || data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices[0]?.delta || {};
      if (delta.reasoning_content) {
        parts.thought.hidden = false;
        parts.thought.textContent += delta.reasoning_content;
      }
      parts.answer.textContent += delta.content || "";
      usage = chunk.usage || usage;
    });
    const thought = parts.thought.hidden ? {} : { reasoning_content: parts.thought.textContent };
    chat.history.push({ role: "user", content: text },
                      { role: "assistant", content: parts.answer.textContent, ...thought });
    $("message").value = "";
    setStatus("chat-status", usage ? `${usage.completion_tokens} tokens` : "done");
  } catch (error) {
    asked.remove();
    reply.remove();
    setStatus("chat-status", error.message, true);
  } finally {
    $("send").disabled = false;
  }
}

function newChat() {
  chat.history = [];
  $("messages").replaceChildren();
  setStatus("chat-status", "");
}

function onEvent(block) {
  const event = /^event: (.*)$/m.exec(block)?.[1] || "message";
  const data = JSON.parse(/^data: (.*)$/m.exec(block)[1]);
  if (event === "message") $("continuation").textContent += data.text;
  else if (event === "done") setStatus("gen-status", `${Math.round(data.total_ms)} ms`);
  else setStatus("gen-status", data.error, true);
}

function linesOf(id) {
  return $(id).value.split("\n").filter((line) => line.trim());
}

async function encode(path) {
  const texts = linesOf("lines");
  if (!texts.length) return setStatus("enc-status", "type a line first", true);
  const body = { texts };
  const pairs = state.pairs && path === "/v1/classify";   // a classifier of pairs
  if (pairs) {
    body.text_pairs = linesOf("seconds");
    if (body.text_pairs.length !== texts.length) {
      return setStatus("enc-status", `${texts.length} texts but ${body.text_pairs.length} ` +
                       "second texts: give each line its second text", true);
    }
  }
  try {
    const data = await api(path, body);
    resultRows(texts.map((text, i) => [
      pairs ? `${text} | ${body.text_pairs[i]}` : text,
      path === "/v1/classify"
        ? `${data.predictions[i].label} (${data.predictions[i].probability.toFixed(3)})`
        : `[${data.embeddings[i].slice(0, 4).map((v) => v.toFixed(3)).join(", ")}, …] ` +
          `(${data.dimensions} dims)`]));
    setStatus("enc-status", `${Math.round(data.timings.total_ms)} ms`);
  } catch (error) {
    setStatus("enc-status", error.message, true);
  }
}

// The attention of the first line (and its second text, for a classifier of pairs).
async function encoderAttention() {
  const texts = linesOf("lines");
  if (!texts.length) return setStatus("enc-status", "type a line first", true);
  const request = { text: texts[0], decimals: 3 };
  const seconds = state.pairs ? linesOf("seconds") : [];
  if (seconds.length) request.text_pair = seconds[0];
  await showExplored("encoder-attention", "enc-status", request,
                     (data) => [data.text, `${data.tokens.length} pieces`]);
}

// The attention of the prompt's greedy continuation (temperature aside).
async function generationAttention() {
  const prompt = $("prompt").value;
  if (!prompt) return setStatus("gen-status", "type a prompt first", true);
  await showExplored("generate-attention", "gen-status",
                     { prompt, max_new_tokens: Number($("max-new").value), decimals: 3 },
                     (data) => {
                       $("prompt-echo").textContent = data.prompt;
                       $("continuation").textContent = data.continuation;
                       return [data.prompt + data.continuation, "greedy · log-probability " +
                               data.log_prob.toFixed(3)];
                     });
}

// The explorer of a request, the text its maps are of above them; `shown` gives that
// text and the status's note.
async function showExplored(buttonId, statusId, request, shown) {
  $(buttonId).disabled = true;
  setStatus(statusId, "reading the attention…");
  const started = performance.now();
  try {
    const data = await explore(request);
    const [text, note] = shown(data);
    $("explorer-text").textContent = text;
    setStatus(statusId, `${Math.round(performance.now() - started)} ms · ${note}`);
  } catch (error) {
    $("explorer").hidden = true;
    setStatus(statusId, error.message, true);
  } finally {
    $(buttonId).disabled = false;
  }
}

// ---------------------------------------------------------------- start

function resultRows(rows) {
  $("enc-output").replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const cellText of cells) {
      const td = document.createElement("td");
      td.textContent = cellText;
      tr.append(td);
    }
    return tr;
  }));
}

async function rerank() {
  const query = $("query").value.trim(), documents = linesOf("lines");
  if (!query) return setStatus("enc-status", "type a query first", true);
  if (!documents.length) return setStatus("enc-status", "type the documents, one a line", true);
  try {
    const data = await api("/v1/rerank", { query, documents });
    resultRows(data.results.map((r) => [r.document.text, r.relevance_score.toFixed(3)]));
    setStatus("enc-status", `${Math.round(data.timings.total_ms)} ms`);
  } catch (error) {
    setStatus("enc-status", error.message, true);
  }
}

async function tag() {
  const texts = linesOf("lines");
  if (!texts.length) return setStatus("enc-status", "type a line first", true);
  try {
    const data = await api("/v1/tag", { texts });
    resultRows(texts.map((text, i) => [
      text,
      data.words[i].map((w) => `${w.word}/${w.tag}`).join(" "),
      data.entities[i].map((e) => `${e.kind}: ${e.text}`).join(" · ")]));
    setStatus("enc-status", `${Math.round(data.timings.total_ms)} ms`);
  } catch (error) {
    setStatus("enc-status", error.message, true);
  }
}

async function answer() {
  const question = $("question").value.trim(), contexts = linesOf("lines");
  if (!question) return setStatus("enc-status", "type a question first", true);
  if (!contexts.length) return setStatus("enc-status", "type the contexts, one a line", true);
  try {
    const data = await api("/v1/answer", { questions: contexts.map(() => question), contexts,
                                           no_answer: $("no-answer").checked });
    resultRows(contexts.map((context, i) => {
      const best = data.answers[i][0];
      return [context, best?.text ? `${best.text} (${best.score.toFixed(3)})`
                                  : `(no answer${best ? ` ${best.score.toFixed(3)}` : ""})`];
    }));
    setStatus("enc-status", `${Math.round(data.timings.total_ms)} ms`);
  } catch (error) {
    setStatus("enc-status", error.message, true);
  }
}

async function start() {
  try {
    const models = await (await fetch("/v1/models")).json();
    const model = models.data[0];
    const languages = model.languages;
    const pair = languages ? ` · ${languages.source} → ${languages.target}` : "";
    const size = model.parameters ? ` · ${(model.parameters / 1e6).toFixed(1)}M parameters` : "";
    $("model-info").textContent = `${model.id} · ${model.kind}${pair}${size}`;
    state.attentionMaps = model.attention_maps !== false;
    $("encoder-attention").hidden = $("generate-attention").hidden = !state.attentionMaps;
    if (model.language_codes) setUpLanguages(model.language_codes, languages);
    $("no-doubles").checked = Boolean(model.limits?.no_doubles);    // the server's default
    state.pairs = model.classifier_inputs === "pairs";
    $("seconds").hidden = !state.pairs;
    $("query").hidden = $("rerank").hidden = !model.reranks;     // a cross-encoder
    $("classify").hidden = !model.classifies;
    $("tag").hidden = !model.tags;                 // a token classifier
    $("question").hidden = $("answer").hidden = !model.answers;    // a question answerer
    $("no-answer-choice").hidden = !model.answers;
    $("chat-panel").hidden = !model.chat;          // an instruct model with a template
  } catch (error) { /* the page still works */ }
  $("explorer-title").textContent = EXPLORER_TITLES[KIND];
  $("explorer-text").hidden = KIND === "translation";     // the translate box shows it
  setUpExplorerControls();
  if (KIND === "translation") {
    $("translate-panel").hidden = false;
    $("translate").addEventListener("click", translate);
    $("source").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) translate();
    });
  } else if (KIND === "generation") {
    $("generate-panel").hidden = false;
    $("generate").addEventListener("click", generate);
    $("generate-attention").addEventListener("click", generationAttention);
    $("send").addEventListener("click", send);
    $("new-chat").addEventListener("click", newChat);
    $("message").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send();
    });
  } else {
    $("encoder-panel").hidden = false;
    $("classify").addEventListener("click", () => encode("/v1/classify"));
    $("embed").addEventListener("click", () => encode("/v1/embed"));
    $("rerank").addEventListener("click", rerank);
    $("tag").addEventListener("click", tag);
    $("answer").addEventListener("click", answer);
    $("encoder-attention").addEventListener("click", encoderAttention);
  }
}

const EXPLORER_TITLES = { translation: "Attention of this translation",
                          encoder: "Self-attention of this text",
                          generation: "Self-attention of this continuation (causal)" };

function setUpExplorerControls() {
  document.querySelectorAll(".segmented button").forEach((button) =>
    button.addEventListener("click", () => {
      state.kind = button.dataset.kind;
      state.hover = null;
      const layers = range(1, state.meta.layers[state.kind]).map(String);
      fillSelect($("layer"), layers, String(state.layer));
      state.layer = Number($("layer").value);
      showLayer();
    }));
  $("layer").addEventListener("change", () => {
    state.layer = Number($("layer").value);
    showLayer();
  });
  $("head").addEventListener("change", () => { state.head = $("head").value; render(); });
  $("map").addEventListener("mousemove", (e) => {
    const matrix = currentMaps()?.[Number(state.head) - 1];
    if (!matrix) return;
    const cell = $("map").width / matrix[0].length;
    const row = Math.floor(e.offsetY / cell), column = Math.floor(e.offsetX / cell);
    if (row < matrix.length && column < matrix[0].length) hover({ row, column });
  });
  $("map").addEventListener("mouseleave", () => hover(null));
  $("rollout").addEventListener("change", toggleRollout);
}

start();
