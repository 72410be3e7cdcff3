// The page's shell: the server's state from /health (polled every second), the API key, the tabs.
// chat.js and dashboard.js subscribe with PagedServe.on("health" | "info", fn). Every URL is relative
// to the page (and its <base>), so the page works behind --root-path.
(function (global) {
  "use strict";

  const PS = global.PagedServe;
  const $ = (id) => document.getElementById(id);
  const KEY_NAME = "pagedserve.apiKey";
  const POLL_MS = 1000;
  const listeners = {};
  const server = { ready: false, status: 0, health: null, model: null, info: null, loading: false };

  function on(event, fn) { (listeners[event] ||= []).push(fn); }
  function emit(event, value) { for (const fn of listeners[event] || []) fn(value); }

  // ---- the API key: kept in this tab (sessionStorage), or in this browser when the user asks -------------
  function apiKey() { return sessionStorage.getItem(KEY_NAME) || localStorage.getItem(KEY_NAME) || ""; }

  function authHeaders(extra) {
    const headers = Object.assign({}, extra);
    const key = apiKey();
    if (key) headers.Authorization = "Bearer " + key;
    return headers;
  }

  function askForKey(message) {
    const form = $("key-form");
    $("key-error").textContent = message || "";
    if (form.hidden) {
      form.hidden = false;
      $("api-key").focus();
      emit("key", false);  // no sending until a key is given
    }
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_NAME, key);
    if ($("remember-key").checked) localStorage.setItem(KEY_NAME, key);
    else localStorage.removeItem(KEY_NAME);
    $("api-key").value = "";
    $("key-form").hidden = true;
    emit("key", true);
    server.model = null;  // load the model list again, with the key
    if (server.ready) loadServer();
  });

  // fetch() with the key; a 401 asks for it (again).
  async function api(path, options = {}) {
    const response = await fetch(path, Object.assign({}, options, { headers: authHeaders(options.headers) }));
    if (response.status === 401) askForKey(apiKey() ? "The server refused this key: enter it again." : "");
    return response;
  }

  // The message of an OpenAI-style error body, or the status line.
  async function errorText(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
    } catch (_) { /* not JSON */ }
    return `${response.status} ${response.statusText}`;
  }

  // ---- what the server is doing -----------------------------------------------------------------------
  async function loadServer() {
    if (server.loading) return;
    server.loading = true;
    try {
      const models = await api("v1/models");
      if (!models.ok) return;
      const body = await models.json();
      server.model = body.data && body.data.length ? body.data[0].id : null;
      $("model-name").textContent = server.model || "";
      const info = await api("server_info");
      if (info.ok) {
        server.info = await info.json();
        emit("info", server.info);
      }
    } catch (_) {
      server.model = null;  // the server went away: the next ready /health retries
    } finally {
      server.loading = false;
    }
  }

  // The phase and its progress; "" for the first phase, which is named like the status ("starting: starting").
  function describePhase(body) {
    if (!body || body.phase === "starting") return "";
    const progress = body.progress === null || body.progress === undefined ? "" : ` ${Math.round(body.progress * 100)}%`;
    return `${body.phase}${progress}`;
  }

  function renderStatus() {
    const status = $("status");
    const body = server.health;
    let text;
    let kind;
    if (server.status === 0) { text = "unreachable"; kind = "error"; }
    else if (server.ready) { text = body && body.memory_pressure && body.memory_pressure.active ? "ready, memory pressure" : "ready"; kind = "ready"; }
    else if (body && body.status === "starting") {
      text = describePhase(body) ? `starting: ${describePhase(body)}` : "starting";
      kind = "starting";
    }
    else { text = `error: ${(body && (body.error || body.phase)) || server.status}`; kind = "error"; }
    status.textContent = text;
    status.className = `status ${kind}`;
    const starting = !server.ready && body && body.status === "starting";
    $("startup-banner").hidden = !starting;
    if (starting) {
      $("startup-phase").textContent = body.phase === "starting" ? "" : body.phase;
      $("startup-sep").hidden = body.phase === "starting";
      $("startup-progress-text").textContent = body.progress === null ? "" : `${Math.round(body.progress * 100)}%`;
      const bar = $("startup-progress");
      if (body.progress === null) bar.removeAttribute("value");
      else bar.value = body.progress;
    }
  }

  async function pollHealth() {
    let status = 0;
    let body = null;
    try {
      const response = await fetch("health", { cache: "no-store" });
      status = response.status;
      body = await response.json();
    } catch (_) { /* unreachable: status 0 */ }
    server.status = status;
    server.health = body;
    server.ready = status === 200;
    if (!server.ready) server.model = null;  // a restarted server may serve another name: ask again when ready
    if (server.ready && !server.model && $("key-form").hidden) loadServer();  // (with a key form: once it is given)
    renderStatus();
    emit("health", server);
    setTimeout(pollHealth, POLL_MS);
  }

  // ---- tabs and the conversation drawer -----------------------------------------------------------------
  const TABS = [["tab-chat", "view-chat"], ["tab-dashboard", "view-dashboard"]];

  function selectTab(tabId, focus) {
    for (const [tab, view] of TABS) {
      const selected = tab === tabId;
      $(tab).setAttribute("aria-selected", String(selected));
      $(tab).tabIndex = selected ? 0 : -1;
      $(view).hidden = !selected;
    }
    if (focus) $(tabId).focus();
    history.replaceState(null, "", tabId === "tab-dashboard" ? "#dashboard" : "#chat");
    emit("tab", tabId);
  }

  for (const [tab] of TABS) {
    $(tab).addEventListener("click", () => selectTab(tab, false));
    $(tab).addEventListener("keydown", (event) => {  // arrow keys move between tabs (WAI-ARIA tabs)
      if (event.key !== "ArrowLeft" && event.key !== "ArrowRight") return;
      const index = TABS.findIndex(([t]) => t === tab);
      selectTab(TABS[(index + (event.key === "ArrowRight" ? 1 : TABS.length - 1)) % TABS.length][0], true);
    });
  }

  $("toggle-sidebar").addEventListener("click", () => {
    const open = document.body.classList.toggle("sidebar-open");
    $("toggle-sidebar").setAttribute("aria-expanded", String(open));
  });

  Object.assign(PS, { $, on, emit, api, errorText, server, describePhase });
  document.addEventListener("DOMContentLoaded", () => {
    selectTab(location.hash === "#dashboard" ? "tab-dashboard" : "tab-chat", false);
    pollHealth();
  });
})(window);
