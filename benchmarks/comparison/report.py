"""The Markdown report of a run: the setting, each model's table, the targets, the peers, how figures are made."""

from __future__ import annotations

import json
from typing import Any

from .figures import BUSY_OTHERS_SHARE, fmt, ratio, spread, summarize
from .targets import render_targets
from .workloads import W3_PROMPT_LEN


def render_model(record: dict[str, Any]) -> list[str]:
    table = summarize(record)
    get = lambda key, metric: spread(table.get(key, {}).get(metric, []))  # noqa: E731
    workloads = {w["name"]: w for w in record["workloads"]}
    params = f"{record['num_params'] / 1e6:.0f} M parameters, " if record.get("num_params") else ""
    lines = [f"### {record['name']}", "", f"{params}{record['description']}; tokenizer: {record['tokenizer']}.", ""]
    lines += ["| Workload | Metric | pagedserve | HF generate | HF continuous batching | pagedserve / HF generate "
              "| pagedserve / HF CB |", "|---|---|---|---|---|---|---|"]
    for name in ("W1", "W2"):
        if name not in workloads:
            continue
        metrics = [("output", "output tok/s")] + ([("total", "total tok/s")] if name == "W2" else [])
        for metric, label in metrics:
            ps, hf, cb = (get(f"{s}/{name}", metric) for s in ("pagedserve", "hf-generate", "hf-cb"))
            lines.append(f"| {name} | {label} | {fmt(ps)} | {fmt(hf)} | {fmt(cb)} | {ratio(ps, hf)} | {ratio(ps, cb)} |")
    int8 = get("pagedserve-int8/W1", "output")
    if int8:
        lines.append(f"| W1 | output tok/s, pagedserve `--quantization int8` | {fmt(int8)} | | | "
                     f"{ratio(int8, get('hf-generate/W1', 'output'))} (vs HF bf16) | |")
    ps3, hf3, srv3 = (get(f"{s}/W3", "seconds") for s in ("pagedserve", "hf-generate", "pagedserve-serve"))
    if ps3 or hf3 or srv3:
        lines.append(f"| W3 | s to first token (lower is better) | {fmt(ps3, 2)} | {fmt(hf3, 2)} | — | "
                     f"{ratio(ps3, hf3)} (time ratio) | — |")
        if srv3:
            lines.append(f"| W3 | s to first token, `pagedserve serve` over HTTP | {fmt(srv3, 2)} | | | "
                         f"{ratio(srv3, hf3)} (time ratio) | |")
    lines += ["", "Figures: median (min–max) over the timed repeats; ratios are of medians (rates: above 1 means "
              "pagedserve is faster; W3 times: below 1 means pagedserve is faster).", ""]
    lines += _render_counts(record, table)
    return lines


def _render_counts(record: dict[str, Any], table: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["Warm-up (first call, excluded above), tokens counted per timed run (prompt, output, early stops), "
             "load time and peak RSS of each worker process:", "",
             "| System / workload | Warm-up output tok/s | Warm-up s | Counted tokens per run |", "|---|---|---|---|"]
    for key, slot in table.items():
        if key.endswith("/W3"):
            continue
        warm = slot.get("warmup") or {}
        counts = ", ".join(f"{p} + {o} (early stops {e})" for p, o, e in sorted(slot["tokens"]))
        lines.append(f"| {key} | {warm.get('output', float('nan')):.1f} | {warm.get('elapsed_s', float('nan')):.2f} "
                     f"| {counts} |")
    lines += ["", "| Worker | Load s | Torch threads | Peak RSS MiB |", "|---|---|---|---|"]
    for name, info in record["systems"].items():
        lines.append(f"| {name} | {info.get('load_s', float('nan')):.2f} | {info.get('threads')} | "
                     f"{info.get('peak_rss_mib', float('nan')):.0f} |")
    w3_rss = {key: spread(slot["rss"]) for key, slot in table.items() if key.endswith("/W3")}
    if w3_rss:
        lines += ["", "W3 peak RSS (MiB, median over repeats): " + ", ".join(
            f"{key.removesuffix('/W3')} {stat['median']:.0f}" for key, stat in w3_rss.items() if stat) + "."]
    if record.get("skipped"):
        lines += ["", f"Not run on this model (time budget; `--all-extras` runs them): {', '.join(record['skipped'])}."]
    if record["errors"]:
        lines += ["", "Failures:", ""] + [f"- `{key}`: {message}" for key, message in record["errors"].items()]
    return lines + [""]


def render_peer(entry: dict[str, Any], ours: dict[str, Any] | None) -> list[str]:
    during = entry.get("load_average_1min_during")
    lines = [f"### {entry['peer']} on {entry['model']} — run {entry['date']}", "",
             f"Command: `{entry['command']}` (exit {entry['returncode']}, {entry['wall_s']:.0f} s wall; 1-minute load "
             f"average, which counts the peer's own threads, before {entry['load_average_before'][0]:.2f}, after "
             f"{entry['load_average_after'][0]:.2f}"
             + (f", during: mean {during['mean']:.2f}, max {during['max']:.2f}" if during else "")
             + _contention_text(entry.get("others_cpu_share") is not None and
                                {"others_cpu_share": entry["others_cpu_share"], "own_cpu_share": entry["own_cpu_share"]}
                                or None) + ").", ""]
    if (entry.get("others_cpu_share") or 0.0) > BUSY_OTHERS_SHARE:
        lines += [f"**Other processes used {entry['others_cpu_share']:.0%} of the CPU time during this run: these "
                  "figures are below what this peer does on a quiet machine.**", ""]
    elif entry.get("others_cpu_share") is None and entry.get("disturbed"):
        lines += ["**Other processes competed for the cores during this run (see the note): these figures are "
                  "below what this peer does on a quiet machine.**", ""]
    if entry.get("note"):
        lines += [entry["note"], ""]
    if entry.get("failure"):
        lines += ["It failed; the last lines of its output:", "", "```", entry["failure"], "```", ""]
    table = summarize(ours) if ours else {}
    ps_w1 = spread(table.get("pagedserve/W1", {}).get("output", []))
    ps_w2 = spread(table.get("pagedserve/W2", {}).get("output", []))
    ps_int8 = spread(table.get("pagedserve-int8/W1", {}).get("output", []))
    for result in entry["results"]:
        lines += _render_peer_result(entry["peer"], result, ps_w1, ps_w2, ps_int8)
    return lines


def _render_peer_result(peer: str, result: dict[str, Any], ps_w1: dict | None, ps_w2: dict | None,
                        ps_int8: dict | None = None) -> list[str]:
    if peer == "vllm-cpu":
        w1 = [call["out_tok_s"] for call in result.get("W1", [])[1:]]  # call 1 is its warm-up
        w2 = [run["out_tok_s"] for run in result.get("W2", [])]
        w2_total = [run["total_tok_s"] for run in result.get("W2", [])]
        w1_stat, w2_stat = spread(w1), spread(w2)
        return [f"vLLM {result.get('vllm_version')}: W1 {fmt(w1_stat)} output tok/s (calls 2-4; call 1 warm-up "
                f"{result['W1'][0]['out_tok_s']:.1f}) · W2 {fmt(w2_stat)} output tok/s, {fmt(spread(w2_total))} "
                f"total tok/s (its 2 runs) · process start to LLM ready {result.get('W0_from_process_start_s', 0):.1f} s "
                f"· peak RSS over its processes {result.get('peak_rss_tree_sum_MiB', 0):.0f} MiB.",
                f"pagedserve (this run) / vLLM: W1 {ratio(ps_w1, w1_stat)}, W2 {ratio(ps_w2, w2_stat)}.", ""]
    if peer == "llama-cpp" and "W2_batched" in result:
        runs = result["W2_batched"]
        if not runs:
            return [f"llama.cpp batched W2 (`{result.get('command')}`) gave no result; see the peer log.", ""]
        w2_stat = spread([r["out_tok_s"] for r in runs])
        return [f"llama.cpp {result['gguf']} GGUF, W2 batched (32 sequences per decode call, "
                f"benchmarks/llamacpp_batched_w2.py): {fmt(w2_stat)} output tok/s, "
                f"{fmt(spread([r['total_tok_s'] for r in runs]))} total; prefill "
                f"{fmt(spread([r['prefill_s'] for r in runs]))} s, then {fmt(spread([r['decode_tok_s'] for r in runs]))} "
                f"tok/s decoding ({len(runs)} runs after a warm-up).",
                f"pagedserve (this run, bf16) / llama.cpp batched: W2 {ratio(ps_w2, w2_stat)}.", ""]
    if peer == "llama-cpp":
        w1_stat = spread(result.get("W1_tok_s", []))
        w2 = result.get("W2_sequential_out_tok_s")
        w2_stat = spread([w2]) if w2 else None
        return [f"llama.cpp {result.get('gguf')} GGUF: W1 {fmt(w1_stat)} tok/s (3 runs after an 8-token warm-up) · "
                f"W2 run one sequence at a time (not batched): {w2} output tok/s, {result.get('W2_total_tok_s')} total "
                f"· load {result.get('load_s', 0):.2f} s.",
                f"pagedserve (this run, bf16) / llama.cpp {result.get('gguf')}: W1 {ratio(ps_w1, w1_stat)}, "
                f"W2 {ratio(ps_w2, w2_stat)} (sequential W2)."
                + (f" pagedserve int8 / llama.cpp {result.get('gguf')}: W1 {ratio(ps_int8, w1_stat)}." if ps_int8 else ""),
                ""]
    return ["```", json.dumps(result), "```", ""]


def _contention_text(contention: dict[str, float] | None) -> str:
    if not contention:
        return "; CPU time of other processes meanwhile: not measured"
    return (f"; other processes used {contention['others_cpu_share']:.0%} of the machine's CPU time meanwhile "
            f"(this run {contention['own_cpu_share']:.0%})")


def render(report: dict[str, Any], peers: list[dict[str, Any]]) -> str:
    meta = report["meta"]
    machine, git = meta["machine"], meta["git"]
    lines = ["# pagedserve vs Hugging Face transformers (and peers): side-by-side figures", "",
             f"Measured {meta['date']} by `benchmarks/compare.py`{' (--quick smoke run)' if meta['quick'] else ''}.", "",
             "Reproduce (from the repository root):", "", "```", meta["command"], "```", "",
             *([f"This report was rendered again on {meta['rendered']['date']} from the run's JSON, figures unchanged "
                f"(`{meta['rendered']['command']}`).", ""] if meta.get("rendered") else []),
             "## Setting", "",
             f"- Commit: `{git['commit']}` ({git['subject']})"
             + (f"; uncommitted changes in {', '.join(git['uncommitted_engine_files'])} were in the measured tree"
                if git["uncommitted_engine_files"] else "; clean tree under pagedserve/"),
             f"- Machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs ({machine['usable_cores']} usable), "
             f"{machine['memory_gib']:.1f} GiB, kernel {machine['kernel']}"
             + (", virtual machine" if machine["hypervisor"] else ""),
             f"- CPU class `{machine.get('cpu_class', '?')}`; flags that matter here: "
             f"{' '.join(machine['flags']) or 'none of avx2/avx512/amx'}",
             f"- Load average (1 min) at start {meta['load_start'][0]:.2f}, at end {meta['load_end'][0]:.2f} "
             "(it counts the benchmark's own threads too)" + _contention_text(meta.get("contention")),
             "- Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- Threads: {meta['threads']} for every system; dtype bfloat16 everywhere; greedy; EOS ignored; "
             f"{meta['repeats']} timed repeats after one warm-up call per workload; max_model_len {meta['max_model_len']}",
             "- Workloads: " + "; ".join(f"{w['name']} {w['description']}" for w in meta["workloads"])
             + f"; W3 process start to first token of a {W3_PROMPT_LEN}-token prompt (fresh process per repeat)",
             "- Thread-related environment: " + (", ".join(f"{k}={v}" for k, v in meta.get("environment", {}).items())
                                                 or "none set (OpenMP defaults: idle threads spin)"),
             f"- Wall time of the run: {meta['wall_s'] / 60:.1f} min", "",
             "## Results", ""]
    for record in report["models"]:
        lines += render_model(record)
    lines += render_targets(report, peers)
    lines += ["## Peers", ""]
    if not peers:
        lines += ["No peer results included (run with --with-llamacpp / --with-vllm, or --peer-json FILE).", ""]
    for entry in peers:
        ours = next((m for m in report["models"] if m["name"] == entry["model"]), None)
        lines += render_peer(entry, ours)
    if peers:
        lines += ["Peer figures come from their own scripts (`../shared/peers/*/run.sh`), run on the date shown, "
                  "not interleaved with the figures above: compare ratios knowing the machine noise (~±10 %).", ""]
    lines += ["## Embeddings", "",
              "Embedding throughput (all-MiniLM-L6-v2 and a decoder without LM head, pagedserve vs "
              "sentence-transformers, side by side in one process) is measured by `python benchmarks/embeddings.py`; "
              "its report is `benchmarks/RESULTS_embeddings.md`.", ""]
    lines += ["## How the figures are made", "",
              "- Each system runs in its own worker process, loaded once; the workers take turns repeat by repeat "
              "(order alternating), so noise from other work on the machine falls on all of them.",
              "- Prompts are random token ids (ordinary ids of the tokenizer, the same for every system in a repeat, "
              "new in every repeat so that no prefix cache is reused across runs).",
              "- Rates = tokens counted in the outputs / wall time of the call (prefill included). HF generate runs "
              "the batch as one padding-free batch (all prompts have equal length); HF continuous batching uses "
              "`generate_batch` with its KV cache sized for the workload (automatic sizing takes 10-20 s per call "
              "on CPU) and includes its manager start-up in each call.",
              "- W3 pagedserve: `LLM(...)` (which pages in the weights and runs its own warm-up, so the first "
              "request is not cold) then one token; HF: `from_pretrained` then `generate(max_new_tokens=1)`; "
              "`pagedserve serve`: time to /health 200 plus the first streamed request's TTFT.", ""]
    return "\n".join(lines)
