"""The dashboard: live figures move while `pagedserve bench serve` loads the server; the server's description."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.browser.browser_utils import screenshot

FIGURES = ("running", "kv_usage", "prompt_tps", "generation_tps", "ttft", "itl", "memory")


def figure(page, name: str) -> float | None:
    raw = page.get_attribute(f'[data-metric="{name}"]', "data-value")
    return float(raw) if raw else None


def test_figures_move_during_a_bench_run(open_page, server, tmp_path):
    page = open_page(server.url + "/#dashboard")
    page.wait_for_selector("#status.ready")
    page.wait_for_function("document.getElementById('server-info').textContent.includes('LlamaForCausalLM')")
    info = page.locator("#server-info").text_content()
    assert "float32" in info and "decoder layers" in info and "needs " in info and "max_model_len 4096" in info
    page.wait_for_function("document.querySelector('[data-metric=running]').dataset.value === '0'")

    bench = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", "bench", "serve", "--base-url", server.url, "--num-prompts", "48",
         "--max-concurrency", "4", "--input-len", "64", "--output-len", "192", "--ignore-eos", "--no-progress",
         "--request-timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = dict.fromkeys(FIGURES, 0.0)
    try:
        while bench.poll() is None:
            for name in FIGURES:
                peak[name] = max(peak[name], figure(page, name) or 0.0)
            time.sleep(0.2)
    finally:
        if bench.poll() is None:
            bench.kill()
        output = bench.communicate(timeout=30)[0]
    assert bench.returncode == 0, output
    screenshot(page, "dashboard-after-bench")
    assert peak["running"] >= 1 and peak["kv_usage"] > 0, peak
    assert peak["prompt_tps"] > 0 and peak["generation_tps"] > 0, peak
    assert peak["ttft"] > 0 and peak["itl"] > 0 and peak["memory"] > 0, peak
    assert "plan " in page.locator("#card-memory .sub").text_content()
    # The bench's 24 requests show in the finished count and in the latency histograms' last minute.
    page.wait_for_function("document.querySelector('#card-running .sub').textContent.match(/^(\\d+) finished/)[1] >= 24")
    assert "last minute" in page.locator("#card-itl .sub").text_content()
    # One point per second's poll: a quick run may have drawn only two yet, so wait for a third (it keeps polling).
    page.wait_for_function("document.querySelector('#card-generation_tps polyline')"
                           ".getAttribute('points').trim().split(/\\s+/).length >= 3")
    # Back to idle once the run is over.
    page.wait_for_function("document.querySelector('[data-metric=running]').dataset.value === '0'")
    page.wait_for_function("document.querySelector('[data-metric=generation_tps]').dataset.value === '0'")


def test_latency_window_survives_a_server_restart(open_page, server):
    """A minute's window across a restart: the new process's counters start at 0, so the difference with the old
    process's samples was negative and the card read "since start" for up to a minute (QA-W); a count that went
    down is a reset, and the window is what the new process counted."""
    page = open_page(server.url + "/#dashboard")
    delta = page.evaluate("""() => [
        PagedServe.bucketDelta([[0.1, 5], [1, 9], [Infinity, 10]], [[0.1, 2], [1, 3], [Infinity, 4]]),
        PagedServe.bucketDelta([[0.1, 1], [1, 2], [Infinity, 2]], [[0.1, 40], [1, 90], [Infinity, 95]])]""")
    inf = float("inf")
    assert delta[0] == [[0.1, 3], [1, 6], [inf, 6]]
    assert delta[1] == [[0.1, 1], [1, 2], [inf, 2]]
    assert page.evaluate("PagedServe.histogramQuantile(0.5, [[0.1, 1], [1, 2], [Infinity, 2]])") > 0
