// The dashboard: the start-up phase while /health is 503, then figures from /metrics polled every second
// (rates from counter deltas, latency percentiles from the histograms' last minute), drawn as small SVG
// charts over the last five minutes, and the server's model, kernels and memory plan (/server_info).
(function (global) {
  "use strict";

  const PS = global.PagedServe;
  const { $ } = PS;
  const HISTORY_S = 300;
  const QUANTILE_WINDOW_S = 60;
  const SVG = "http://www.w3.org/2000/svg";
  const history = [];  // {t, values} per poll, the last HISTORY_S seconds
  const histograms = [];  // {t, buckets} per poll, for the quantile window
  let previous = null;  // the last poll's {t, samples}, for rates

  const number = (digits) => (v) => (v === null || v === undefined ? "\u2013" : v.toFixed(digits));
  const percent = (v) => (v === null || v === undefined ? "\u2013" : `${(v * 100).toFixed(1)} %`);
  const seconds = (v) => (v === null || v === undefined ? "\u2013" : v < 1 ? `${(v * 1000).toFixed(1)} ms` : `${v.toFixed(2)} s`);

  function bytes(v) {
    if (v === null || v === undefined) return "\u2013";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return `${v.toFixed(i ? 2 : 0)} ${units[i]}`;
  }

  // One card per figure; `series` are the history keys its chart draws (the first is the headline number).
  const CARDS = [
    { id: "running", title: "Running requests", series: ["running"], format: number(0) },
    { id: "waiting", title: "Waiting requests", series: ["waiting"], format: number(0) },
    { id: "kv_usage", title: "KV-cache usage", series: ["kv_usage"], format: percent, max: 1 },
    { id: "prompt_tps", title: "Prompt tokens/s", series: ["prompt_tps"], format: number(1) },
    { id: "generation_tps", title: "Generation tokens/s", series: ["generation_tps"], format: number(1) },
    { id: "ttft", title: "Time to first token (p50, p90, p99)", series: ["ttft_p50", "ttft_p99"], format: seconds },
    { id: "itl", title: "Inter-token latency (p50, p90, p99)", series: ["itl_p50", "itl_p99"], format: seconds },
    { id: "memory", title: "Resident memory / plan", series: ["rss", "planned_rss"], format: bytes },
  ];

  function buildCards() {
    const box = $("cards");
    for (const card of CARDS) {
      const node = document.createElement("div");
      node.className = "card";
      node.id = `card-${card.id}`;
      const title = document.createElement("h3");
      title.textContent = card.title;
      const value = document.createElement("div");
      value.className = "value";
      value.dataset.metric = card.id;
      value.textContent = "\u2013";
      const sub = document.createElement("div");
      sub.className = "sub muted";
      const chart = document.createElementNS(SVG, "svg");
      chart.setAttribute("class", "chart");
      chart.setAttribute("viewBox", "0 0 300 60");
      chart.setAttribute("preserveAspectRatio", "none");
      chart.setAttribute("aria-hidden", "true");
      node.append(title, value, sub, chart);
      box.append(node);
    }
  }

  function drawChart(card) {
    const chart = document.querySelector(`#card-${card.id} .chart`);
    const now = history.length ? history[history.length - 1].t : 0;
    const span = history.length ? Math.min(HISTORY_S, Math.max(60, now - history[0].t)) : HISTORY_S;  // seconds across
    let top = card.max || 0;
    for (const point of history) for (const key of card.series) top = Math.max(top, point.values[key] || 0);
    top = top || 1;
    const lines = card.series.map((key, i) => {
      const points = history.filter((p) => p.values[key] !== null && p.values[key] !== undefined)
        .map((p) => `${(300 - 300 * (now - p.t) / span).toFixed(1)},${(58 - 56 * p.values[key] / top).toFixed(1)}`);
      const line = document.createElementNS(SVG, "polyline");
      line.setAttribute("points", points.join(" "));
      line.setAttribute("class", `series s${i}`);
      return line;
    });
    chart.replaceChildren(...lines);
    chart.parentElement.querySelector(".sub").dataset.chartMax = String(top);
  }

  function setCard(id, value, sub) {
    const card = CARDS.find((c) => c.id === id);
    const node = document.querySelector(`[data-metric="${id}"]`);
    node.textContent = card.format(value);
    node.dataset.value = value === null || value === undefined ? "" : String(value);
    if (sub !== undefined) node.parentElement.querySelector(".sub").textContent = sub;
  }

  // Quantiles of a histogram over the last minute (or since start while the minute holds nothing).
  function quantiles(name, buckets, now) {
    const current = buckets[name];
    const earlier = histograms.find((h) => now - h.t <= QUANTILE_WINDOW_S);
    let window = PS.bucketDelta(current, earlier && earlier.buckets[name]);
    let scope = "last minute";
    if (!window || PS.histogramQuantile(0.5, window) === null) { window = current; scope = "since start"; }
    const q = (p) => PS.histogramQuantile(p, window);
    return { p50: q(0.5), p90: q(0.9), p99: q(0.99), count: window ? window[window.length - 1][1] : 0, scope };
  }

  function onMetrics(text) {
    const now = performance.now() / 1000;
    const { samples, buckets } = PS.parseMetrics(text);
    const get = (name) => (name in samples ? samples[name] : null);
    const rate = (name) => {
      if (!previous || !(name in samples) || !(name in previous.samples)) return null;
      return Math.max(0, samples[name] - previous.samples[name]) / (now - previous.t);
    };
    const ttft = quantiles("vllm:time_to_first_token_seconds", buckets, now);
    const itl = quantiles("vllm:inter_token_latency_seconds", buckets, now);
    const values = {
      running: get("vllm:num_requests_running"), waiting: get("vllm:num_requests_waiting"),
      kv_usage: get("vllm:kv_cache_usage_perc"),
      prompt_tps: rate("vllm:prompt_tokens_total"), generation_tps: rate("vllm:generation_tokens_total"),
      ttft_p50: ttft.p50, ttft_p99: ttft.p99, itl_p50: itl.p50, itl_p99: itl.p99,
      rss: get("pagedserve:resident_memory_bytes"), planned_rss: get("pagedserve:planned_resident_memory_bytes"),
    };
    previous = { t: now, samples };
    histograms.push({ t: now, buckets });
    history.push({ t: now, values });
    while (history.length && now - history[0].t > HISTORY_S) history.shift();
    while (histograms.length && now - histograms[0].t > QUANTILE_WINDOW_S + 5) histograms.shift();
    render(values, ttft, itl, samples);
  }

  function render(values, ttft, itl, samples) {
    const finished = samples["vllm:request_success_total"] || 0;
    setCard("running", values.running, `${finished} finished since start`);
    setCard("waiting", values.waiting, "");
    setCard("kv_usage", values.kv_usage, "of the KV pool's blocks in use");
    setCard("prompt_tps", values.prompt_tps, `${samples["vllm:prompt_tokens_total"] || 0} prompt tokens since start`);
    setCard("generation_tps", values.generation_tps,
      `${samples["vllm:generation_tokens_total"] || 0} generated since start`);
    const q = (r) => `${seconds(r.p50)} \u00B7 ${seconds(r.p90)} \u00B7 ${seconds(r.p99)} (${r.scope}, ${r.count} obs.)`;
    setCard("ttft", ttft.p50, q(ttft));
    setCard("itl", itl.p50, q(itl));
    const over = values.rss && values.planned_rss ? values.rss / values.planned_rss - 1 : null;
    setCard("memory", values.rss, values.planned_rss ? `plan ${bytes(values.planned_rss)} (${over >= 0 ? "+" : ""}${(over * 100).toFixed(0)} %)` : "no reading yet (one comes after a request)");
    for (const card of CARDS) drawChart(card);
  }

  async function pollMetrics() {
    try {
      const response = await fetch("metrics", { cache: "no-store" });
      if (response.ok) onMetrics(await response.text());
    } catch (_) { /* the status pill says the server is unreachable */ }
  }

  // ---- start-up and the server's description ----------------------------------------------------------------
  function renderStartup(server) {
    const body = server.health;
    const starting = !server.ready && body && body.phases;
    $("startup-card").hidden = !starting;
    if (!starting) return;
    $("dash-phase").textContent = body.phase;
    $("dash-progress-text").textContent = body.progress === null ? "" : `${Math.round(body.progress * 100)}%`;
    $("dash-elapsed").textContent = `${body.elapsed_s.toFixed(1)} s since process start`;
    const bar = $("dash-progress");
    if (body.progress === null) bar.removeAttribute("value");
    else bar.value = body.progress;
    $("dash-phases").replaceChildren(...body.phases.map((p) => {
      const li = document.createElement("li");
      li.textContent = p.duration_s === null ? `${p.name} \u2026` : `${p.name} ${p.duration_s.toFixed(2)} s`;
      return li;
    }));
  }

  function renderInfo(info) {
    const rows = [];
    const row = (term, ...details) => rows.push([term, details]);
    const m = info.model;
    row("Model", `${m.name} (${m.architecture})`, m.path);
    row("dtype", `${m.dtype}${m.quantization ? `, ${m.quantization} weights` : ""}; KV cache ${info.cache.kv_cache_dtype}`);
    row("Context", `max_model_len ${m.max_model_len}; ${info.scheduler.max_num_seqs} sequences, ` +
      `${info.scheduler.max_num_batched_tokens} tokens a step`);
    row("Device", `${info.device}, ${info.num_threads} thread${info.num_threads === 1 ? "" : "s"}`);
    row("Kernels", ...info.kernels);
    row("KV cache", `${info.cache.num_blocks} blocks of ${info.cache.block_size} tokens, prefix caching ` +
      `${info.cache.enable_prefix_caching ? "on" : "off"}`);
    const plan = info.memory_plan;
    if (plan) {
      row("Memory plan", plan.summary, `weights ${bytes(plan.weight_bytes)}, KV pool ${bytes(plan.kv_pool_bytes)}, ` +
        `activations ${bytes(plan.activation_bytes)}, overhead ${bytes(plan.overhead_bytes)}; steady ` +
        `${bytes(plan.steady_bytes)}`, plan.kv_cache.how);
    }
    row("Version", `pagedserve ${info.version}`);
    const dl = $("server-info");
    dl.replaceChildren();
    for (const [term, details] of rows) {
      const dt = document.createElement("dt");
      dt.textContent = term;
      dl.append(dt);
      for (const detail of details) {
        const dd = document.createElement("dd");
        dd.textContent = detail;
        dl.append(dd);
      }
    }
  }

  buildCards();
  PS.on("health", (server) => {
    renderStartup(server);
    if (server.ready) pollMetrics();
  });
  PS.on("info", renderInfo);
})(window);
