// Reading the server's /metrics (Prometheus text format) for the dashboard: samples summed over label
// sets (one model per server), rates from counter deltas, and histogram quantiles the way Prometheus's
// histogram_quantile() computes them (linear inside the bucket that holds the rank).
(function (global) {
  "use strict";

  const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

  function parseValue(text) {
    if (text === "+Inf") return Infinity;
    if (text === "-Inf") return -Infinity;
    return Number(text);
  }

  // Text -> { samples: {name: total}, buckets: {histogram name: [[le, cumulative count], ...] sorted} }.
  function parseMetrics(text) {
    const samples = {};
    const buckets = {};
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const m = line.match(SAMPLE);
      if (!m) continue;
      const [, name, labels, raw] = m;
      const value = parseValue(raw);
      if (!Number.isFinite(value)) continue;
      if (name.endsWith("_bucket")) {
        let le = null;
        for (const l of (labels || "").matchAll(LABEL)) if (l[1] === "le") le = parseValue(l[2]);
        if (le === null) continue;
        const family = (buckets[name.slice(0, -"_bucket".length)] ||= new Map());
        family.set(le, (family.get(le) || 0) + value);
      } else {
        samples[name] = (samples[name] || 0) + value;
      }
    }
    const sorted = {};
    for (const [name, family] of Object.entries(buckets)) sorted[name] = [...family.entries()].sort((a, b) => a[0] - b[0]);
    return { samples, buckets: sorted };
  }

  // Cumulative buckets now minus the same buckets earlier (what happened in between); earlier may be null. A count
  // that went down means the server restarted in between (its counters start again at 0, Prometheus's reset rule):
  // then everything now holds happened in between.
  function bucketDelta(now, earlier) {
    if (!now) return null;
    if (!earlier) return now;
    const before = new Map(earlier);
    if (now.some(([le, count]) => count < (before.get(le) || 0))) return now;
    return now.map(([le, count]) => [le, count - (before.get(le) || 0)]);
  }

  // The q-quantile (0..1) of cumulative buckets [[le, count], ...], or null when they hold no observation.
  function histogramQuantile(q, buckets) {
    if (!buckets || !buckets.length) return null;
    const total = buckets[buckets.length - 1][1];
    if (!(total > 0)) return null;
    const rank = q * total;
    let lowerBound = 0;
    let lowerCount = 0;
    for (const [le, count] of buckets) {
      if (count >= rank) {
        if (le === Infinity) return lowerBound;  // above the largest finite bound: report that bound
        if (count === lowerCount) return le;
        return lowerBound + (le - lowerBound) * (rank - lowerCount) / (count - lowerCount);
      }
      lowerBound = le;
      lowerCount = count;
    }
    return lowerBound;
  }

  global.PagedServe = Object.assign(global.PagedServe || {}, { parseMetrics, bucketDelta, histogramQuantile });
})(window);
