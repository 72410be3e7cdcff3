"""The speed targets a full report checks, read from targets.toml (one row per target), against this run's
figures and the peers' saved results."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from .figures import peer_disturbed, spread, summarize

TARGETS_FILE = Path(__file__).with_name("targets.toml")
# Peer figures a target may name as `other` (medians from the peers' saved JSON on the report's model).
PEER_FIGURES = ("vllm_w1", "vllm_w2", "vllm_ready", "vllm_rss", "llama_w1_bf16", "llama_w1_q8", "llama_w2")


def _peer_figures(peers: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """Medians the targets need, from the peers' results on `model` (None where a peer gave none)."""
    figures: dict[str, Any] = dict.fromkeys((*PEER_FIGURES, "vllm_disturbed", "llama_disturbed"))
    for entry in peers:
        if entry["model"] != model:
            continue
        figures["vllm_disturbed" if entry["peer"] == "vllm-cpu" else "llama_disturbed"] = peer_disturbed(entry)
        for result in entry["results"]:
            if entry["peer"] == "vllm-cpu":
                figures["vllm_w1"] = spread([call["out_tok_s"] for call in result.get("W1", [])[1:]])
                figures["vllm_w2"] = spread([run["out_tok_s"] for run in result.get("W2", [])])
                ready = result.get("W0_from_process_start_s")
                figures["vllm_ready"] = spread([ready] if ready else [])
                rss = result.get("peak_rss_tree_sum_MiB")
                figures["vllm_rss"] = spread([rss] if rss else [])
            elif entry["peer"] == "llama-cpp" and "W2_batched" in result:
                figures["llama_w2"] = spread([r["out_tok_s"] for r in result["W2_batched"]])
            elif entry["peer"] == "llama-cpp":
                key = "llama_w1_bf16" if result.get("gguf") == "bf16" else "llama_w1_q8"
                figures[key] = spread(result.get("W1_tok_s", []))
    return figures


PEER_CAVEATS = {True: " — but the peer ran on a busy machine: not a fair comparison",
                None: " — peer run's CPU contention unknown: indicative only", False: ""}


def load_targets(path: Path = TARGETS_FILE) -> dict[str, Any]:
    return tomllib.loads(path.read_text())


def _target_row(name: str, value: dict | None, other: dict | None, goal: float, inverse: bool = False,
                peer_disturbed: bool | None = False) -> str:
    """One target: pagedserve's median against `goal` x the other's (inverse: pagedserve <= goal x other)."""
    if value is None or other is None or not other["median"]:
        return f"| {name} | — | not measured in this report |"
    achieved = value["median"] / other["median"]
    met = achieved <= goal if inverse else achieved >= goal
    return f"| {name} | {achieved:.2f}x | {'met' if met else 'not met'}{PEER_CAVEATS[peer_disturbed]} |"


def _absolute_row(name: str, value: dict | None, at_least: float, unit: str) -> str:
    if value is None:
        return f"| {name} | — | — |"
    return f"| {name} | {value['median']:.1f} {unit} | {'met' if value['median'] >= at_least else 'not met'} |"


def _our_figures(record: dict[str, Any]) -> dict[str, dict | None]:
    """pagedserve's (and transformers') figures the targets name: "<system>/<workload>" output rates, "ready", "rss"."""
    table = summarize(record)
    figures: dict[str, dict | None] = {key: spread(slot.get("output", [])) for key, slot in table.items()
                                       if not key.endswith("/W3")}
    figures["ready"] = spread([w3["marks"]["loaded"] for w3 in record["w3"]
                               if w3["system"] == "pagedserve" and "loaded" in w3.get("marks", {})])
    rss = record["systems"].get("pagedserve", {}).get("peak_rss_mib")
    figures["rss"] = spread([rss] if rss else [])
    return figures


def render_targets(report: dict[str, Any], peers: list[dict[str, Any]], targets: dict[str, Any] | None = None
                   ) -> list[str]:
    """The speed targets (targets.toml) on the Qwen2.5-0.5B-shaped model (bf16); none for a --quick run."""
    record = next((m for m in report["models"] if m["kind"] == "random"), None)
    if record is None or report["meta"]["quick"]:
        return []
    targets = targets or load_targets()
    peer = _peer_figures(peers, record["name"])
    figures = {**_our_figures(record), **peer}
    rows = []
    for target in targets["target"]:
        value = figures.get(target["value"])
        if "at_least" in target:
            rows.append(_absolute_row(target["name"], value, target["at_least"], target.get("unit", "")))
            continue
        disturbed = peer[f"{target['peer']}_disturbed"] if "peer" in target else False
        rows.append(_target_row(target["name"], value, figures.get(target["other"]), target["goal"],
                                inverse=target.get("inverse", False), peer_disturbed=disturbed))
    return [f"## {targets['title']}", "", "| Target | Measured | Status |", "|---|---|---|", *rows,
            "", targets["context"], ""]
