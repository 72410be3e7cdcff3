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
  // max_tokens left out: the server gives what the context leaves (vLLM's and OpenAI's default); a fixed 512 was
  // refused outright by a server with a short context.
  const DEFAULTS = { system: "", temperature: 0.7, top_p: 1, max_tokens: "", seed: "", json_mode: false, extra: "" };
  const STALE_MS = 5000;  // a reply another tab streams saves at least once a second; older than this, it stopped
  // Fields the page sets itself: from the extra fields they would break the stream it reads.
  const PAGE_FIELDS = ["messages", "stream", "stream_options"];

  let conversations = loadConversations();
  let currentId = localStorage.getItem(CURRENT);
  let settings = loadSettings();
  let streaming = null;  // {controller, conversation, message} while a reply streams
  let renderQueued = false;
  let lastSaved = 0;
  const deleted = new Set();  // conversations deleted here: another tab's copy must not bring them back
  const stored = new Set();  // conversations seen in storage: one missing there now was deleted by another tab

  function loadJSON(key, fallback) {
    try {
      const value = JSON.parse(localStorage.getItem(key));
      return value === null ? fallback : value;
    } catch (_) {
      return fallback;
    }
  }

  // What storage holds, as far as it is conversations: valid JSON of another shape (an object, null entries, a
  // conversation without messages) threw at start-up and left a page whose Send did nothing (QA-W).
  function loadConversations() { return readConversations().valid; }

  // {valid: the conversations, unreadable: how many stored entries were not (the store itself, if not a list)}
  function readConversations() {
    const value = loadJSON(STORE, []);
    const list = Array.isArray(value) ? value : [];
    const valid = list.filter((c) => c && typeof c === "object" && typeof c.id === "string" &&
      Array.isArray(c.messages) && c.messages.every((m) => m && typeof m === "object" &&
        typeof m.role === "string" && typeof m.content === "string"));
    for (const conversation of valid) {
      if (typeof conversation.title !== "string") conversation.title = "Untitled";
    }
    return { valid, unreadable: Array.isArray(value) ? list.length - valid.length : 1 };
  }

  // The settings, each of its default's kind (a null or a number where text goes blocked every send).
  function loadSettings() {
    const value = loadJSON(SETTINGS, {});
    const result = Object.assign({}, DEFAULTS);
    if (!value || typeof value !== "object") return result;
    for (const key of Object.keys(DEFAULTS)) {
      const kind = typeof DEFAULTS[key];
      const ok = kind === "boolean" ? typeof value[key] === "boolean" :
        typeof value[key] === "string" || (kind === "number" && typeof value[key] === "number");
      if (ok) result[key] = value[key];
    }
    return result;
  }

  // Each change stamps its conversation; of two tabs' copies of one conversation the later-changed one is kept
  // (the whole list of the last tab to save was kept: a reply streamed in one tab was wiped by the other).
  function touch(conversation) { conversation.updated = Date.now(); }

  // This tab's conversations merged with what storage holds now: conversations added elsewhere taken, those deleted
  // elsewhere dropped, of one in both the later-changed copy; the reply streaming here always ours.
  function merge(others) {
    const live = streaming ? streaming.conversation : null;
    const theirs = new Map(others.filter((c) => !deleted.has(c.id)).map((c) => [c.id, c]));
    const merged = [];
    for (const ours of conversations) {
      const other = theirs.get(ours.id);
      theirs.delete(ours.id);
      if (other === undefined) {
        if (ours === live || !stored.has(ours.id)) merged.push(ours);  // new here, not yet saved: kept
      } else {
        merged.push(ours === live || (ours.updated || 0) >= (other.updated || 0) ? ours : other);
      }
    }
    conversations = [...theirs.values(), ...merged];
    for (const conversation of others) stored.add(conversation.id);  // (readConversations: each has its id)
  }

  // Writes the conversations, merged with another tab's (above). A full storage is said, not thrown: a throw froze
  // the reply it came in.
  function save() {
    lastSaved = Date.now();
    if (streaming) streaming.message.beat = lastSaved;
    merge(loadConversations());
    try {
      localStorage.setItem(STORE, JSON.stringify(conversations));
      for (const conversation of conversations) stored.add(conversation.id);
      if (currentId) localStorage.setItem(CURRENT, currentId);
      $("chat-error").textContent = "";
    } catch (error) {
      $("chat-error").textContent = "This browser's storage is full, so the conversations are no longer saved: " +
        "export the ones to keep, then delete old ones.";
    }
  }

  // Another tab saved: take its conversations, changes and deletions (merge), or its settings.
  global.addEventListener("storage", (event) => {
    if (event.key === SETTINGS) {
      settings = loadSettings();
      showSettings();
      return;
    }
    if (event.key !== STORE) return;
    merge(loadConversations());
    settleStale();
    renderConversations();
    if (!streaming) renderMessages(true);
  });

  // A reply another tab streams is shown pending (no reply can be sent under it); one whose tab stopped saving
  // (closed, crashed) stays as far as it got.
  function settleStale() {
    const now = Date.now();
    for (const conversation of conversations) {
      for (const message of conversation.messages) {
        if (isPendingElsewhere(message) && !(now - (message.beat || 0) < STALE_MS)) {
          message.pending = false;
          message.note = "interrupted (the page was closed)";
        }
      }
    }
  }

  function isPendingElsewhere(message) { return message.pending && message !== (streaming && streaming.message); }

  function pendingElsewhere(conversation) { return conversation.messages.some(isPendingElsewhere); }

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

  // A reply that was streaming when the page went away stays as far as it got (saved as the page goes, below);
  // one that another tab streams still is stays pending.
  for (const conversation of conversations) stored.add(conversation.id);
  settleStale();
  global.addEventListener("pagehide", () => {  // a reload or close mid-reply: keep what arrived since the last save
    if (!streaming) return;
    streaming.message.pending = false;
    streaming.message.note = "interrupted (the page was closed)";
    touch(streaming.conversation);
    save();
  });
  setInterval(() => {  // another tab's reply that stopped without a word (its tab was killed)
    if (!conversations.some(pendingElsewhere)) return;
    settleStale();
    if (!streaming) renderMessages(true);
  }, STALE_MS);

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
    let done = false;  // Esc re-renders the list, removing the input, whose blur then came as a second finish(true)
    const finish = (keep) => {
      if (done) return;
      done = true;
      if (keep && input.value.trim() && input.value.trim() !== conversation.title) {
        conversation.title = input.value.trim();
        touch(conversation);
      }
      save();
      renderConversations();
      const title = document.querySelector(`.conversation[data-id="${CSS.escape(conversation.id)}"] .title`);
      if (title) title.focus();
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") { event.preventDefault(); finish(true); }
      if (event.key === "Escape") { event.stopPropagation(); finish(false); }
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
                   messages: conversation.messages.map(({ role, content, reasoning, stats }) =>
                     ({ role, content, reasoning, stats })) };  // reasoning: a thinking model's, where there was
    const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
    const a = document.createElement("a");
    a.href = url;
    // Letters and digits of any script kept (a Chinese title was saved as "_.json"); 60 characters, not UTF-16 units
    const name = Array.from(conversation.title.replace(/[^\p{L}\p{N}.-]+/gu, "_").replace(/^[_.]+|_+$/g, ""));
    a.download = `${name.slice(0, 60).join("") || "conversation"}.json`;
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
    if (message.role !== "assistant") {
      body.textContent = message.content;
      return;
    }
    const parts = [];
    if (message.reasoning) parts.push(reasoningNode(body, message));
    parts.push(PS.renderMarkdown(message.content));
    body.replaceChildren(...parts);
  }

  // A thinking model's reasoning (a server with --reasoning-parser), folded above the reply as plain text. The node
  // is reused while the reply streams, so a fold the user opened or closed stays so; open while the reply is pending.
  function reasoningNode(body, message) {
    let details = body.querySelector(":scope > details.reasoning");
    if (!details) {
      details = document.createElement("details");
      details.className = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      const text = document.createElement("div");
      text.className = "reasoning-text";
      details.append(summary, text);
      details.open = Boolean(message.pending);
    }
    details.querySelector(".reasoning-text").textContent = message.reasoning;
    return details;
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

  // keepScroll: stay where the reader scrolled to unless at the bottom (a reply that ended jumped the list down).
  function renderMessages(keepScroll) {
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    const scrolled = box.scrollTop;
    const conversation = current();
    box.replaceChildren(...conversation.messages.map((m, i) => messageNode(conversation, m, i)));
    if (!conversation.messages.length) {
      const empty = document.createElement("p");
      empty.className = "muted empty";
      empty.textContent = "Start the conversation below.";
      box.append(empty);
    }
    box.scrollTop = keepScroll && !atBottom ? scrolled : box.scrollHeight;
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

  function renderAll(keepScroll) {
    renderConversations();
    renderMessages(keepScroll);
    showSendOrStop();
  }

  // Stop where the reply streams; elsewhere Send, disabled until it ends (one reply at a time: a Stop shown in
  // another conversation stopped this one's reply, QA-W).
  function showSendOrStop() {
    const here = Boolean(streaming) && streaming.conversation === current();
    $("send").hidden = here;
    $("stop").hidden = !here;
    $("send").disabled = !canSend() || Boolean(streaming);
    $("send").title = streaming && !here ? "A reply is being written in another conversation" : "";
  }

  // Ready, and where the server wants a key, one given (a message sent before it came back as a 401 reply).
  function canSend() { return PS.server.ready && $("key-form").hidden; }

  function startEdit(node, conversation, index) {
    const message = conversation.messages[index];
    const editor = document.createElement("textarea");
    editor.className = "edit";
    editor.value = message.content;
    editor.setAttribute("aria-label", "Edit message");
    const resend = () => {  // the fields checked first: a failed check cut the later messages all the same
      if (!editor.value.trim() || !canSend() || busyElsewhere(conversation) || !extraFieldsParse()) return;
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

  function regenerate(conversation) {  // (a failed check of the extra fields in reply() had popped the reply)
    if (!canSend() || busyElsewhere(conversation) || !extraFieldsParse()) return;
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
    if (settings.extra.trim()) {
      const extra = JSON.parse(settings.extra);
      if (extra === null || typeof extra !== "object" || Array.isArray(extra)) {  // [1,2] became "0": 1, "1": 2
        throw new Error("they must be one JSON object, e.g. {\"ignore_eos\": true}");
      }
      const own = PAGE_FIELDS.filter((field) => field in extra);
      if (own.length) throw new Error(`${own.join(", ")} ${own.length > 1 ? "are" : "is"} set by the page`);
      Object.assign(body, extra);
    }
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
      const thought = choice && choice.delta && (choice.delta.reasoning || choice.delta.reasoning_content);
      if (thought) {  // a thinking model's reasoning (--reasoning-parser): before the content, shown apart
        if (timing.first === null) timing.first = performance.now();
        message.reasoning = (message.reasoning || "") + thought;
      }
      if (choice && choice.delta && choice.delta.content) {
        if (timing.first === null) timing.first = performance.now();
        message.content += choice.delta.content;
      }
      if (choice && choice.finish_reason) timing.finish = choice.finish_reason;
      if (chunk.usage && (choice || !timing.usage)) timing.usage = chunk.usage;  // the first choice's, where given
    }
    return false;
  }

  // Returns whether the stream ended as the server ends one ([DONE]); a connection closed before it cut the reply.
  async function readStream(response, message, timing, conversation) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (applyEvent(event, message, timing)) return true;
      }
      queueReplyRender();
      if (Date.now() - lastSaved > 1000) { touch(conversation); save(); }
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
    touch(conversation);
    save();
    renderAll();
    const timing = { start: performance.now(), first: null, finish: null, usage: null };
    try {
      const response = await PS.api("v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        signal: controller.signal });
      if (!response.ok) throw new Error(await PS.errorText(response));
      const complete = await readStream(response, message, timing, conversation);
      message.stats = replyStats(timing, performance.now());
      if (!complete && !timing.finish) message.note = "incomplete: the connection closed before the reply ended";
    } catch (error) {
      if (error.name === "AbortError") {
        message.note = "stopped";
        message.stats = replyStats(timing, performance.now());
      } else if (error instanceof TypeError) {  // fetch's own: the connection failed or dropped
        message.stats = replyStats(timing, performance.now());
        message.error = `The connection to the server was lost (${error.message})` +
          (message.content ? ": the reply stops here." : ".");
      } else {
        message.error = error.message + contextHint(error.message);
      }
    } finally {
      message.pending = false;
      streaming = null;
      touch(conversation);
      save();
      renderAll(true);
      if ($("key-form").hidden) $("prompt").focus();  // else the key field, which asks for the key
    }
  }

  // What to do about a context-length 400: the conversation alone no longer fits (every later turn fails the same
  // way), or max_tokens asks for more than it leaves (the conversation goes on with less, or with none set).
  function contextHint(text) {
    if (/leaves no room for the completion/.test(text)) {
      return " \u2014 the conversation no longer fits the model's context: start a new chat, or edit an earlier " +
        "message";
    }
    const asked = text.match(/context length is (\d+) tokens.*\((\d+) in the prompt, \d+ for the completion\)/);
    if (!asked) return "";
    const left = Number(asked[1]) - Number(asked[2]);
    return ` \u2014 the conversation leaves ${left} tokens for the reply: lower max_tokens to at most ${left}, or ` +
      "clear it (the server then gives what the context leaves)";
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

  // A reply another tab is writing to this conversation: one more turn now would go in under it.
  function busyElsewhere(conversation) {
    if (!pendingElsewhere(conversation)) return false;
    $("chat-error").textContent = "Another tab is still writing a reply in this conversation: wait for it, or " +
      "start a new chat.";
    return true;
  }

  function send() {
    const text = $("prompt").value;
    if (!text.trim() || streaming || !canSend() || !extraFieldsParse()) return;
    const conversation = current();
    if (busyElsewhere(conversation)) return;
    if (conversation.title === "New chat") {  // 40 characters, not UTF-16 units (half an emoji)
      conversation.title = Array.from(text.trim().split("\n")[0]).slice(0, 40).join("");
    }
    conversation.messages.push({ role: "user", content: text });
    touch(conversation);
    $("prompt").value = "";
    reply(conversation);
  }

  function stop() {
    if (streaming) streaming.controller.abort();
  }

  // ---- settings ---------------------------------------------------------------------------------------------
  function showSettings() {
    for (const input of document.querySelectorAll("[data-setting]")) {
      if (input.type === "checkbox") input.checked = Boolean(settings[input.dataset.setting]);
      else input.value = settings[input.dataset.setting];
    }
  }

  function bindSettings() {
    showSettings();
    for (const input of document.querySelectorAll("[data-setting]")) {
      const key = input.dataset.setting;
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
  $("new-chat").addEventListener("click", () => {  // this one if it is empty (conversations[0] may be another tab's)
    const conversation = current();
    selectConversation((conversation.messages.length ? createConversation() : conversation).id);
  });
  $("export-chat").addEventListener("click", exportConversation);

  let wasReady = null;
  PS.on("health", (server) => {
    if (server.ready !== wasReady) {
      wasReady = server.ready;
      showSendOrStop();
    }
  });
  PS.on("key", showSendOrStop);

  bindSettings();
  if (matchMedia("(max-width: 900px)").matches) $("settings").open = false;  // a phone: the chat first
  current();
  renderAll();
  const { unreadable } = readConversations();  // said once, at load (each save drops them)
  if (unreadable) {
    const which = unreadable === 1 ? "A stored conversation" : `${unreadable} stored conversations`;
    $("chat-error").textContent = `${which} could not be read (not this page's format): left out, and dropped ` +
      "at the next save.";
  }
})(window);
