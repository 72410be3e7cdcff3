"""The numbers of a report: spreads over repeats, ratios of medians, and whether a peer's run was disturbed."""

from __future__ import annotations

import statistics
from typing import Any

BUSY_OTHERS_SHARE = 0.15  # other processes used more than 15 % of the machine's CPU time: figures are disturbed


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def fmt(stat: dict[str, float] | None, digits: int = 1) -> str:
    if stat is None:
        return "—"
    return f"{stat['median']:.{digits}f} ({stat['min']:.{digits}f}–{stat['max']:.{digits}f})"


def ratio(numerator: dict | None, denominator: dict | None) -> str:
    if not numerator or not denominator or not denominator["median"]:
        return "—"
    return f"{numerator['median'] / denominator['median']:.2f}x"


def summarize(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """(system, metric) -> spread over the timed repeats; plus the warm-up figures."""
    table: dict[str, dict[str, Any]] = {}
    for run in record["runs"]:
        key = f"{run['system']}/{run['workload']}"
        slot = table.setdefault(key, {"output": [], "total": [], "warmup": None, "tokens": set()})
        output_rate = run["num_output_tokens"] / run["elapsed_s"]
        total_rate = (run["num_output_tokens"] + run["num_prompt_tokens"]) / run["elapsed_s"]
        if run["repeat"] == "warmup":
            slot["warmup"] = {"output": output_rate, "elapsed_s": run["elapsed_s"]}
        else:
            slot["output"].append(output_rate)
            slot["total"].append(total_rate)
            slot["tokens"].add((run["num_prompt_tokens"], run["num_output_tokens"], run.get("num_early_stops", 0)))
    for w3 in record["w3"]:
        table.setdefault(f"{w3['system']}/W3", {"seconds": [], "rss": []})
        table[f"{w3['system']}/W3"]["seconds"].append(w3["first_token_s"])
        table[f"{w3['system']}/W3"]["rss"].append(w3.get("peak_rss_mib") or 0.0)
    return table


def peer_disturbed(entry: dict[str, Any]) -> bool | None:
    """True when other processes took a measurable share of the CPU during the peer's run; None if unknown
    (runs recorded before the share was measured carry a hand-set `disturbed`, or nothing)."""
    if entry.get("others_cpu_share") is not None:
        return entry["others_cpu_share"] > BUSY_OTHERS_SHARE
    return entry.get("disturbed")
