// Loom's web chat: streams /v1/chat/completions, keeps the conversation in this browser only
// (localStorage), and shows the server's /metrics. Model output is rendered by markdown.js,
// which builds DOM nodes from text and never parses HTML.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const STORE = "loom-chat";
  const state = { messages: [], attachments: [], controller: null, voices: [], models: [] };

  function save() {
    try {
      localStorage.setItem(STORE, JSON.stringify({ messages: state.messages, system: $("system").value }));
    } catch (e) { /* full (images): the page still works, the conversation is just not kept */ }
  }

  function load() {
    try {
      const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
      state.messages = Array.isArray(saved.messages) ? saved.messages : [];
      $("system").value = saved.system || "";
    } catch (e) { state.messages = []; }
  }

  function showError(text) {
    $("error").textContent = text;
    $("error").hidden = !text;
  }

  function textOf(content) {
    if (typeof content === "string") return content;
    return content.filter((p) => p.type === "text").map((p) => p.text).join("\n");
  }

  function bubble(message) {
    const node = document.createElement("div");
    node.className = "msg " + message.role;
    const role = document.createElement("div");
    role.className = "role";
    role.textContent = message.role === "user" ? "You" : message.model || "assistant";
    const body = document.createElement("div");
    body.className = "body";
    const stats = document.createElement("div");
    stats.className = "stats";
    node.append(role, body, stats);
    fill(node, message);
    $("messages").append(node);
    node.scrollIntoView({ block: "end" });
    return node;
  }

  function fill(node, message) {
    const body = node.querySelector(".body");
    body.replaceChildren();
    if (message.role === "user") {
      body.append(document.createTextNode(textOf(message.content)));
      if (typeof message.content !== "string") {
        for (const part of message.content) {
          if (part.type !== "image_url") continue;
          const img = document.createElement("img");
          img.className = "attachment";
          img.alt = "attached image";
          img.src = part.image_url.url;  // a data: URL this browser made from a local file
          body.append(img);
        }
      }
    } else {
      body.append(window.LoomMarkdown.render(message.content));
    }
    const stats = node.querySelector(".stats");
    stats.replaceChildren();
    if (message.stats) stats.append(document.createTextNode(message.stats));
    if (message.role === "assistant" && message.content && state.voices.length && !message.streaming) {
      const speak = document.createElement("button");
      speak.type = "button";
      speak.className = "speak";
      speak.textContent = "Speak";
      speak.addEventListener("click", () => say(message.content));
      stats.append(" ", speak);
    }
  }

  function redraw() {
    $("messages").replaceChildren();
    for (const m of state.messages) bubble(m);
  }

  async function api(path, options) {
    const response = await fetch(path, options);
    if (!response.ok) {
      let message = response.status + " " + response.statusText;
      try { message = (await response.json()).error.message || message; } catch (e) { /* not JSON */ }
      throw new Error(message);
    }
    return response;
  }

  async function loadModels() {
    const data = (await (await api("/v1/models")).json()).data || [];
    state.voices = data.filter((m) => m.task === "speech").map((m) => m.id);
    state.models = data.filter((m) => m.task !== "speech");
    const select = $("model");
    select.replaceChildren();
    for (const m of state.models) {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = m.id;
      select.append(option);
    }
    updateAttach();
  }

  function updateAttach() {
    const model = state.models.find((m) => m.id === $("model").value);
    const vision = !!model && (model.input_modalities || []).includes("image");
    $("attach-label").hidden = !vision;
  }

  function requestBody() {
    const body = {
      model: $("model").value,
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number($("temperature").value),
      top_p: Number($("top_p").value),
      max_tokens: Number($("max_tokens").value),
    };
    const extra = $("extra").value.trim();
    if (extra) Object.assign(body, JSON.parse(extra));
    const messages = [];
    if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
    for (const m of state.messages) {
      if (!m.error) messages.push({ role: m.role, content: m.content });
    }
    body.messages = messages;
    return body;
  }

  async function send(text) {
    const content = state.attachments.length
      ? [{ type: "text", text }, ...state.attachments.map((url) => ({ type: "image_url", image_url: { url } }))]
      : text;
    let body;
    try {
      state.messages.push({ role: "user", content });
      body = requestBody();
    } catch (e) {
      state.messages.pop();
      showError("Extra parameters: " + e.message);
      return;
    }
    showError("");
    bubble(state.messages[state.messages.length - 1]);
    state.attachments = [];
    $("attachments").replaceChildren();
    const answer = { role: "assistant", content: "", model: body.model, streaming: true };
    state.messages.push(answer);
    const node = bubble(answer);
    const controller = new AbortController();
    state.controller = controller;
    busy(true);
    const started = performance.now();
    let first = null, tokens = null, chunks = 0;
    try {
      const response = await api("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, end).trim();
          buffer = buffer.slice(end + 1);
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const event = JSON.parse(data);
          if (event.error) throw new Error(event.error.message);
          if (event.usage) tokens = event.usage.completion_tokens;
          const delta = (event.choices && event.choices[0] && event.choices[0].delta) || {};
          if (delta.content) {
            if (first === null) first = performance.now();
            chunks++;
            answer.content += delta.content;
          }
        }
        answer.stats = timing(started, first, tokens ?? chunks);
        fill(node, answer);
        node.scrollIntoView({ block: "end" });
      }
    } catch (e) {
      if (e.name === "AbortError") {
        answer.stats = timing(started, first, tokens ?? chunks) + " (stopped)";
      } else {
        answer.error = true;
        answer.stats = "error: " + e.message;
        node.classList.add("error");
      }
    } finally {
      delete answer.streaming;
      state.controller = null;
      busy(false);
      fill(node, answer);
      save();
    }
  }

  function timing(started, first, tokens) {
    if (first === null) return "";
    const ttft = first - started;
    const seconds = (performance.now() - first) / 1000;
    const rate = tokens > 1 && seconds > 0 ? ((tokens - 1) / seconds).toFixed(1) + " tokens/s" : "";
    return `TTFT ${Math.round(ttft)} ms · ${tokens} tokens` + (rate ? " · " + rate : "");
  }

  function busy(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
  }

  async function say(text) {
    try {
      const response = await api("/v1/audio/speech", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ model: state.voices[0], input: text.slice(0, 4000), response_format: "wav" }),
      });
      const url = URL.createObjectURL(await response.blob());
      const audio = new Audio(url);
      audio.addEventListener("ended", () => URL.revokeObjectURL(url));
      await audio.play();
    } catch (e) { showError("speech: " + e.message); }
  }

  function attach(files) {
    for (const file of files) {
      const reader = new FileReader();
      reader.addEventListener("load", () => {
        state.attachments.push(reader.result);
        const tag = document.createElement("span");
        tag.className = "attached";
        tag.textContent = "📎 " + file.name + " ";
        $("attachments").append(tag);
      });
      reader.readAsDataURL(file);
    }
  }

  // ---- the live panel: /metrics every 2 s ----
  let lastTokens = null, lastTime = null;
  function metric(text, name) {
    const re = new RegExp("^" + name.replace(/[:]/g, "\\:") + "(?:\\{[^}]*\\})?\\s+([0-9.eE+-]+)$", "m");
    const m = re.exec(text);
    return m ? Number(m[1]) : null;
  }

  async function poll() {
    try {
      const text = await (await api("/metrics")).text();
      const running = metric(text, "loom:num_requests_running");
      const waiting = metric(text, "loom:num_requests_waiting");
      const kv = metric(text, "loom:kv_cache_usage_perc");
      const generated = metric(text, "loom:generation_tokens_total");
      const now = performance.now();
      $("m-running").textContent = running ?? "-";
      $("m-waiting").textContent = waiting ?? "-";
      $("m-kv").textContent = kv === null ? "-" : (kv * 100).toFixed(1) + " %";
      if (generated !== null && lastTokens !== null) {
        $("m-tps").textContent = ((generated - lastTokens) / ((now - lastTime) / 1000)).toFixed(1);
      }
      lastTokens = generated;
      lastTime = now;
    } catch (e) { $("m-running").textContent = "?"; }
  }

  // ---- wiring ----
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("input").value;
    if (!text.trim() || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("reset").addEventListener("click", () => { state.messages = []; save(); redraw(); });
  $("attach").addEventListener("change", (event) => { attach(event.target.files); event.target.value = ""; });
  $("model").addEventListener("change", updateAttach);
  $("system").addEventListener("change", save);

  load();
  loadModels().then(redraw, (e) => showError("models: " + e.message));
  poll();
  setInterval(poll, 2000);
})();
