// The chat: conversations in localStorage, replies streamed over /v1/chat/completions (SSE), Stop aborts
// the request (the server aborts it and frees its KV blocks when the connection closes), regenerate and
// edit-and-resend, settings, and per reply TTFT and tokens/s from the usage the server counts.
(function (global) {
  "use strict";

  const PS = global.PagedServe;
  const { $ } = PS;
  const STORE = "pagedserve.conversations.v1";
  const CURRENT = "pagedserve.current.v1";
  const SETTINGS = "pagedserve.settings.v1";
  const DEFAULTS = { system: "", temperature: 0.7, top_p: 1, max_tokens: 512, seed: "", json_mode: false, extra: "" };

  let conversations = loadJSON(STORE, []);
  let currentId = localStorage.getItem(CURRENT);
  let settings = Object.assign({}, DEFAULTS, loadJSON(SETTINGS, {}));
  let streaming = null;  // {controller, conversation, message} while a reply streams
  let renderQueued = false;
  let lastSaved = 0;
  const deleted = new Set();  // conversations deleted here: another tab's copy must not bring them back

  function loadJSON(key, fallback) {
    try {
      const value = JSON.parse(localStorage.getItem(key));
      return value === null ? fallback : value;
    } catch (_) {
      return fallback;
    }
  }

  // Writes the conversations, keeping those another tab added meanwhile (two tabs each wrote their own list, and
  // the last one deleted the other's). A full storage is said, not thrown: a throw froze the reply it came in.
  function save() {
    lastSaved = Date.now();
    const ours = new Set(conversations.map((c) => c.id));
    for (const other of loadJSON(STORE, [])) {
      if (other && !ours.has(other.id) && !deleted.has(other.id)) conversations.push(other);
    }
    try {
      localStorage.setItem(STORE, JSON.stringify(conversations));
      if (currentId) localStorage.setItem(CURRENT, currentId);
      $("chat-error").textContent = "";
    } catch (error) {
      $("chat-error").textContent = "This browser's storage is full, so the conversations are no longer saved: " +
        "export the ones to keep, then delete old ones.";
    }
  }

  // Another tab saved: take its conversations (and its deletions), but not over the reply streaming here.
  global.addEventListener("storage", (event) => {
    if (event.key !== STORE) return;
    const others = loadJSON(STORE, []);
    const live = streaming ? streaming.conversation : null;
    conversations = others.filter((c) => !live || c.id !== live.id);
    if (live) conversations.unshift(live);
    renderConversations();
    if (!streaming) renderMessages();
  });

  function newId() { return Date.now().toString(36) + Math.random().toString(36).slice(2, 8); }

  function current() {
    let conversation = conversations.find((c) => c.id === currentId);
    if (!conversation) {
      conversation = conversations[0] || createConversation();
      currentId = conversation.id;
    }
    return conversation;
  }

  function createConversation() {
    const conversation = { id: newId(), title: "New chat", created: new Date().toISOString(), messages: [] };
    conversations.unshift(conversation);
    return conversation;
  }

  // A reply that was streaming when the page went away stays as far as it got.
  for (const conversation of conversations) {
    for (const message of conversation.messages) {
      if (message.pending) { message.pending = false; message.note = "interrupted (the page was closed)"; }
    }
  }

  // ---- the conversation list ------------------------------------------------------------------------------
  function button(text, label, onClick, className) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = text;
    if (label) b.setAttribute("aria-label", label);
    if (className) b.className = className;
    b.addEventListener("click", onClick);
    return b;
  }

  function renderConversations() {
    const list = $("conversations");
    list.replaceChildren();
    for (const conversation of conversations) {
      const item = document.createElement("li");
      item.className = "conversation";
      item.dataset.id = conversation.id;
      const title = button(conversation.title, null, () => selectConversation(conversation.id), "title");
      if (conversation.id === currentId) title.setAttribute("aria-current", "true");
      item.append(title,
        button("\u270E", `Rename ${conversation.title}`, () => startRename(item, conversation), "icon-button rename"),
        button("\u00D7", `Delete ${conversation.title}`, () => deleteConversation(conversation.id), "icon-button delete"));
      list.append(item);
    }
  }

  function startRename(item, conversation) {
    const input = document.createElement("input");
    input.className = "rename-input";
    input.value = conversation.title;
    input.setAttribute("aria-label", "New title");
    const finish = (keep) => {
      if (keep && input.value.trim()) conversation.title = input.value.trim();
      save();
      renderConversations();
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") { event.preventDefault(); finish(true); }
      if (event.key === "Escape") finish(false);
    });
    input.addEventListener("blur", () => finish(true));
    item.replaceChildren(input);
    input.focus();
    input.select();
  }

  function selectConversation(id) {
    currentId = id;
    save();
    renderAll();
    document.body.classList.remove("sidebar-open");
    $("prompt").focus();
  }

  function deleteConversation(id) {
    if (streaming && streaming.conversation.id === id) streaming.controller.abort();
    conversations = conversations.filter((c) => c.id !== id);
    deleted.add(id);
    if (currentId === id) currentId = null;
    current();
    save();
    renderAll();
  }

  function exportConversation() {
    const conversation = current();
    const data = { title: conversation.title, created: conversation.created, model: PS.server.model, settings,
                   messages: conversation.messages.map(({ role, content, stats }) => ({ role, content, stats })) };
    const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
    const a = document.createElement("a");
    a.href = url;
    a.download = `${conversation.title.replace(/[^\w.-]+/g, "_").slice(0, 60) || "conversation"}.json`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  // ---- messages -----------------------------------------------------------------------------------------
  function statsText(message) {
    const s = message.stats;
    if (!s) return message.note || "";
    const parts = [];
    if (s.ttft_s !== undefined) parts.push(`TTFT ${s.ttft_s.toFixed(2)} s`);
    if (s.tokens_per_s !== undefined) parts.push(`${s.tokens_per_s.toFixed(1)} tok/s`);
    if (s.completion_tokens !== undefined) parts.push(`${s.completion_tokens} tokens`);
    if (s.finish_reason) parts.push(`finish: ${s.finish_reason}`);
    if (message.note) parts.push(message.note);
    return parts.join(" \u00B7 ");
  }

  function renderBody(body, message) {
    body.setAttribute("dir", "auto");  // right-to-left text (Arabic, Hebrew) lays out as such
    if (message.role === "assistant") body.replaceChildren(PS.renderMarkdown(message.content));
    else body.textContent = message.content;
  }

  function messageNode(conversation, message, index) {
    const node = document.createElement("article");
    node.className = `message ${message.role}${message.pending ? " pending" : ""}`;
    const role = document.createElement("div");
    role.className = "role";
    role.textContent = message.role === "user" ? "You" : "Assistant";
    const body = document.createElement("div");
    body.className = "body";
    renderBody(body, message);
    node.append(role, body);
    if (message.error) {
      const error = document.createElement("div");
      error.className = "error-text";
      error.setAttribute("role", "alert");
      error.textContent = message.error;
      node.append(error);
    }
    const meta = document.createElement("div");
    meta.className = "meta";
    const stats = document.createElement("span");
    stats.className = "stats";
    stats.textContent = statsText(message);
    meta.append(stats);
    if (!streaming) {
      if (message.role === "user") meta.append(button("Edit", "Edit and resend", () => startEdit(node, conversation, index), "link"));
      if (message.role === "assistant" && index === conversation.messages.length - 1) {
        meta.append(button("Regenerate", null, () => regenerate(conversation), "link regenerate"));
      }
    }
    node.append(meta);
    return node;
  }

  function renderMessages() {
    const box = $("messages");
    const conversation = current();
    box.replaceChildren(...conversation.messages.map((m, i) => messageNode(conversation, m, i)));
    if (!conversation.messages.length) {
      const empty = document.createElement("p");
      empty.className = "muted empty";
      empty.textContent = "Start the conversation below.";
      box.append(empty);
    }
    box.scrollTop = box.scrollHeight;
  }

  // While streaming only the last reply changes: redraw it once per frame, not once per token.
  function queueReplyRender() {
    if (renderQueued) return;
    renderQueued = true;
    requestAnimationFrame(() => {
      renderQueued = false;
      if (!streaming || streaming.conversation.id !== currentId) return;
      const box = $("messages");
      const last = box.lastElementChild;
      const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
      if (last) renderBody(last.querySelector(".body"), streaming.message);
      if (atBottom) box.scrollTop = box.scrollHeight;
    });
  }

  function renderAll() {
    renderConversations();
    renderMessages();
    const busy = Boolean(streaming);
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("send").disabled = !PS.server.ready;
  }

  function startEdit(node, conversation, index) {
    const message = conversation.messages[index];
    const editor = document.createElement("textarea");
    editor.className = "edit";
    editor.value = message.content;
    editor.setAttribute("aria-label", "Edit message");
    const resend = () => {
      if (!editor.value.trim() || !PS.server.ready) return;
      message.content = editor.value;
      conversation.messages = conversation.messages.slice(0, index + 1);
      reply(conversation);
    };
    editor.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); resend(); }
      if (event.key === "Escape") renderMessages();
    });
    const actions = document.createElement("div");
    actions.className = "meta";
    actions.append(button("Send", null, resend, "primary"), button("Cancel", null, renderMessages));
    node.querySelector(".body").replaceChildren(editor);
    node.querySelector(".meta").replaceWith(actions);
    editor.focus();
  }

  function regenerate(conversation) {
    if (!PS.server.ready) return;
    conversation.messages.pop();
    reply(conversation);
  }

  // ---- the request ----------------------------------------------------------------------------------------
  // The conversation as the request's messages: failed empty replies left out, and the user messages they leave
  // next to each other joined (templates that require alternating roles refused every later turn).
  function requestBody(conversation) {
    const messages = [];
    for (const { role, content, error } of conversation.messages) {
      if (error && !content) continue;
      const previous = messages[messages.length - 1];
      if (previous && previous.role === role && role === "user") previous.content += "\n\n" + content;
      else messages.push({ role, content });
    }
    if (settings.system.trim()) messages.unshift({ role: "system", content: settings.system });
    // continuous usage: each chunk carries its choice's own count (the final usage sums every choice of n > 1)
    const body = { messages, stream: true, stream_options: { include_usage: true, continuous_usage_stats: true } };
    if (PS.server.model) body.model = PS.server.model;
    for (const field of ["temperature", "top_p", "max_tokens", "seed"]) {
      if (settings[field] !== "" && settings[field] !== null && !Number.isNaN(Number(settings[field]))) {
        body[field] = Number(settings[field]);
      }
    }
    if (settings.json_mode) body.response_format = { type: "json_object" };
    if (settings.extra.trim()) Object.assign(body, JSON.parse(settings.extra));
    return body;
  }

  // One SSE event's data lines -> the message; returns true at [DONE].
  function applyEvent(event, message, timing) {
    for (const line of event.split("\n")) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return true;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      // The first choice only: with n > 1 in the extra fields, the other choices' deltas are not this reply's
      const choice = chunk.choices && chunk.choices.find((c) => c.index === 0);
      if (choice && choice.delta && choice.delta.content) {
        if (timing.first === null) timing.first = performance.now();
        message.content += choice.delta.content;
      }
      if (choice && choice.finish_reason) timing.finish = choice.finish_reason;
      if (chunk.usage && (choice || !timing.usage)) timing.usage = chunk.usage;  // the first choice's, where given
    }
    return false;
  }

  async function readStream(response, message, timing) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (applyEvent(event, message, timing)) return;
      }
      queueReplyRender();
      if (Date.now() - lastSaved > 1000) save();
    }
  }

  // Tokens/s over the decode: the tokens the server counted after the first, over the time after the first.
  function replyStats(timing, end) {
    const stats = { finish_reason: timing.finish };
    if (timing.first !== null) stats.ttft_s = (timing.first - timing.start) / 1000;
    if (timing.usage) {
      stats.completion_tokens = timing.usage.completion_tokens;
      stats.prompt_tokens = timing.usage.prompt_tokens;
      const seconds = (end - timing.first) / 1000;
      if (timing.first !== null && stats.completion_tokens > 1 && seconds > 0) {
        stats.tokens_per_s = (stats.completion_tokens - 1) / seconds;
      }
    }
    return stats;
  }

  async function reply(conversation) {
    let body;
    try {
      body = requestBody(conversation);
    } catch (error) {
      $("settings-error").textContent = `Extra request fields: ${error.message}`;
      return;
    }
    const message = { role: "assistant", content: "", pending: true };
    conversation.messages.push(message);
    const controller = new AbortController();
    streaming = { controller, conversation, message };
    save();
    renderAll();
    const timing = { start: performance.now(), first: null, finish: null, usage: null };
    try {
      const response = await PS.api("v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        signal: controller.signal });
      if (!response.ok) throw new Error(await PS.errorText(response));
      await readStream(response, message, timing);
      message.stats = replyStats(timing, performance.now());
    } catch (error) {
      if (error.name === "AbortError") {
        message.note = "stopped";
        message.stats = replyStats(timing, performance.now());
      } else {
        message.error = error.message;
        if (/maximum context length/.test(error.message)) {  // every later turn would fail the same way
          message.error += " \u2014 the conversation no longer fits the model's context: start a new chat, or " +
            "edit an earlier message, or lower max_tokens";
        }
      }
    } finally {
      message.pending = false;
      streaming = null;
      save();
      renderAll();
      $("prompt").focus();
    }
  }

  // Whether the extra request fields parse; if not, says why where they are set (and the message waits in the box).
  function extraFieldsParse() {
    try {
      requestBody(current());
    } catch (error) {
      $("settings-error").textContent = `Extra request fields: ${error.message}`;
      return false;
    }
    $("settings-error").textContent = "";
    return true;
  }

  function send() {
    const text = $("prompt").value;
    if (!text.trim() || streaming || !PS.server.ready || !extraFieldsParse()) return;
    const conversation = current();
    if (conversation.title === "New chat") {  // 40 characters, not UTF-16 units (half an emoji)
      conversation.title = Array.from(text.trim().split("\n")[0]).slice(0, 40).join("");
    }
    conversation.messages.push({ role: "user", content: text });
    $("prompt").value = "";
    reply(conversation);
  }

  function stop() {
    if (streaming) streaming.controller.abort();
  }

  // ---- settings ---------------------------------------------------------------------------------------------
  function bindSettings() {
    for (const input of document.querySelectorAll("[data-setting]")) {
      const key = input.dataset.setting;
      if (input.type === "checkbox") input.checked = Boolean(settings[key]);
      else input.value = settings[key];
      input.addEventListener("input", () => {
        settings[key] = input.type === "checkbox" ? input.checked : input.value;
        try {
          localStorage.setItem(SETTINGS, JSON.stringify(settings));
        } catch (_) { /* a full storage: the settings hold for this page; save() says so */ }
        $("settings-error").textContent = "";
      });
    }
  }

  $("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); send(); }
  });
  document.addEventListener("keydown", (event) => {  // Esc stops a reply wherever the focus is (Send hides it)
    if (event.key === "Escape" && streaming) stop();
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    const conversation = current();
    if (conversation.messages.length) createConversation();
    selectConversation(conversations[0].id);
  });
  $("export-chat").addEventListener("click", exportConversation);

  let wasReady = null;
  PS.on("health", (server) => {
    if (server.ready !== wasReady) {
      wasReady = server.ready;
      $("send").disabled = !server.ready;
    }
  });

  bindSettings();
  if (matchMedia("(max-width: 900px)").matches) $("settings").open = false;  // a phone: the chat first
  current();
  renderAll();
})(window);
