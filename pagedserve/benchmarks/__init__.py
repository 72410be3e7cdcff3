"""Honest benchmarks: serving (`bench serve`), start-up (`bench startup`) and the metric math.

Token rates come from counted tokens (usage.completion_tokens), never from elapsed time alone;
warm-up requests are reported apart from steady state; every figure comes with its spread.
"""
