"""Speculative decoding: proposers that guess a request's next tokens, verified by the target model in the
normal step (the scheduler schedules them as extra query tokens; worker/model_runner.py accepts or rejects).
Pure Python here: the scheduler imports it without torch."""
