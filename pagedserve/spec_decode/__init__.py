"""Speculative decoding: proposers that guess a request's next tokens, verified by the target model in the
normal step (the scheduler schedules them as extra query tokens; worker/model_runner.py accepts or rejects).
Pure Python here: the scheduler imports it without torch (a draft model runs in the worker:
worker/draft_model.py)."""


def make_proposer(config):
    """The scheduler's proposer for a SpeculativeConfig (None: speculation off)."""
    if config is None:
        return None
    if config.method == "draft_model":
        from pagedserve.spec_decode.draft import DraftModelProposer

        return DraftModelProposer(config)
    from pagedserve.spec_decode.ngram import NgramProposer

    return NgramProposer(config)
