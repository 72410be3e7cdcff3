"""Embedding plumbing without torch: sentence-transformers files, task choice, PoolingParams, and the
scheduler running pooling requests (prefill only, blocks freed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sched_output import ModelRunnerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.models.pooling_config import (PoolingConfigError, default_task, load_pooler_config,
                                              sentence_transformers_max_seq_length)
from pagedserve.pooling_params import PoolingParams, finish_embedding, tokenize_for_pooling
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

NO_MATRYOSHKA = SimpleNamespace()


def write_st_files(model_dir: Path, pooling: dict, normalize: bool = True, extra_modules: list | None = None) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    modules += extra_modules or []
    (model_dir / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return model_dir


def test_embedding_config_modules_do_not_import_torch():
    code = ("import sys, pagedserve.models.pooling_config, pagedserve.pooling_params; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("pooling,expected", [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, "mean"),  # legacy booleans
    ({"pooling_mode_cls_token": True}, "cls"),
    ({"pooling_mode_lasttoken": True, "include_prompt": True}, "lasttoken"),  # Qwen3-Embedding's file
    ({"pooling_mode": "max"}, "max"),  # sentence-transformers >= 5
    ({"pooling_mode": ["weightedmean"]}, "weightedmean"),
])
def test_pooling_mode_read_from_sentence_transformers_files(tmp_path, pooling, expected):
    config = load_pooler_config(write_st_files(tmp_path, pooling), "BertModel", NO_MATRYOSHKA)
    assert (config.pooling_type, config.normalize) == (expected, True)
    assert "modules.json" in config.source


def test_normalize_only_when_listed(tmp_path):
    config = load_pooler_config(write_st_files(tmp_path, {"pooling_mode": "mean"}, normalize=False), "BertModel",
                                NO_MATRYOSHKA)
    assert config.normalize is False


def test_defaults_without_sentence_transformers_files(tmp_path):
    bert = load_pooler_config(tmp_path, "BertModel", NO_MATRYOSHKA)
    qwen = load_pooler_config(tmp_path, "Qwen3ForCausalLM", NO_MATRYOSHKA)
    assert (bert.pooling_type, bert.normalize) == ("cls", True)
    assert (qwen.pooling_type, qwen.normalize) == ("lasttoken", True)
    assert not qwen.needs_all_tokens and bert.needs_all_tokens


@pytest.mark.parametrize("pooling,extra,word", [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, None, "exactly one"),
    ({"pooling_mode": "median"}, None, "median"),
    ({"pooling_mode": "mean"}, [{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}], "Dense"),
])
def test_unsupported_sentence_transformers_pipelines_are_named(tmp_path, pooling, extra, word):
    write_st_files(tmp_path, pooling, extra_modules=extra)
    with pytest.raises(PoolingConfigError, match=word):
        load_pooler_config(tmp_path, "BertModel", NO_MATRYOSHKA)


def test_matryoshka_declared_in_config_json(tmp_path):
    assert load_pooler_config(tmp_path, "BertModel", NO_MATRYOSHKA).matryoshka_dimensions is None
    assert load_pooler_config(tmp_path, "BertModel", SimpleNamespace(is_matryoshka=True)).matryoshka_dimensions == ()
    dims = SimpleNamespace(matryoshka_dimensions=[64, 128])
    assert load_pooler_config(tmp_path, "BertModel", dims).matryoshka_dimensions == (64, 128)


def test_default_task(tmp_path):
    assert default_task("BertModel", tmp_path) == "embed"
    assert default_task("Qwen3Model", tmp_path) == "embed"
    assert default_task("Qwen3ForCausalLM", tmp_path) == "generate"
    write_st_files(tmp_path, {"pooling_mode_lasttoken": True})
    assert default_task("Qwen3ForCausalLM", tmp_path) == "embed"  # Qwen3-Embedding ships modules.json


def test_max_seq_length(tmp_path):
    assert sentence_transformers_max_seq_length(tmp_path) is None
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 256, "do_lower_case": false}')
    assert sentence_transformers_max_seq_length(tmp_path) == 256


def test_finish_embedding_truncates_then_normalises():
    vector = [0.6, 0.0, 0.8, 0.0]
    assert finish_embedding(vector, None, True) == pytest.approx(vector)
    assert finish_embedding(vector, 1, True) == [1.0]
    assert finish_embedding(vector, 1, False) == [0.6]
    assert finish_embedding([3.0, 4.0, 1.0], 2, True) == pytest.approx([0.6, 0.8])
    assert finish_embedding([3.0, 4.0, 12.0], None, True) == pytest.approx([3 / 13, 4 / 13, 12 / 13])
    assert finish_embedding([3.0, 4.0, 12.0], None, False) == [3.0, 4.0, 12.0]
    assert finish_embedding([0.0, 0.0], None, True) == [0.0, 0.0]  # no division by zero


def test_pooling_params_validation():
    assert PoolingParams().normalize is None and PoolingParams(normalize=False).normalize is False
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams(normalize="yes")
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
    PoolingParams(truncate_prompt_tokens=-1)


class FakeTokenizer:
    truncation_side = "right"

    def encode(self, text: str) -> list[int]:
        return [101] + [len(w) for w in text.split()] + [102]

    def __call__(self, text: str, truncation: bool, max_length: int) -> dict:
        ids = self.encode(text)
        return {"input_ids": ids[:max_length - 1] + [102] if len(ids) > max_length else ids}


def test_tokenize_for_pooling_cuts_texts_on_the_tokenizers_side_and_token_ids_to_their_last_k():
    tok = FakeTokenizer()
    assert tokenize_for_pooling(tok, "a bb ccc", None, 16) == [101, 1, 2, 3, 102]
    assert tokenize_for_pooling(tok, "a bb ccc", 3, 16) == [101, 1, 102]  # the tokenizer keeps [SEP]
    assert tokenize_for_pooling(tok, "a bb ccc", -1, 4) == [101, 1, 2, 102]  # -1: max_model_len
    assert tokenize_for_pooling(tok, [5, 6, 7, 8], 2, 16) == [7, 8]  # vLLM keeps token ids' last k
    tok.truncation_side = "left"
    assert tokenize_for_pooling(tok, [5, 6, 7, 8], 2, 16) == [7, 8]


# ---- the scheduler with pooling requests -----------------------------------------------------------
def pooling_request(rid: str, num_tokens: int) -> Request:
    return Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=1), None, 1, is_pooling=True)


def run_pooling(sched: Scheduler) -> tuple[dict[str, list], list[dict[str, int]]]:
    """Fake runner: the 'vector' is [number of tokens scheduled for the request in total]."""
    seen: dict[str, int] = {}
    results: dict[str, list] = {}
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        steps.append(dict(out.num_scheduled_tokens))
        for rid, num in out.num_scheduled_tokens.items():
            seen[rid] = seen.get(rid, 0) + num
        pooled = {rid: [seen[rid]] for rid, need in out.needs_sample.items() if need}
        for core in sched.update_from_output(out, ModelRunnerOutput(pooled=pooled)):
            assert core.new_token_ids == [] and core.finish_reason == "stop"
            results[core.request_id] = core.pooled
    return results, steps


def make_scheduler(budget: int, chunked: bool, num_blocks: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64,
                             enable_chunked_prefill=chunked)
    return Scheduler(config, KVCacheManager(num_blocks, 4, enable_caching=False))


def test_pooling_requests_run_prefill_only_and_free_their_blocks():
    sched = make_scheduler(budget=32, chunked=True)
    for rid, n in [("a", 5), ("b", 20), ("c", 30)]:
        sched.add_request(pooling_request(rid, n))
    results, steps = run_pooling(sched)
    assert results == {"a": [5], "b": [20], "c": [30]}  # every prompt token computed once, no decode step
    assert steps[0] == {"a": 5, "b": 20, "c": 7}  # c's prompt is chunked across steps
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks - 1 and not sched.kv.req_to_blocks


def test_pooling_without_chunked_prefill_keeps_each_prompt_whole():
    """The encoder setting: a prompt that does not fit the rest of the budget waits for the next step."""
    sched = make_scheduler(budget=32, chunked=False)
    for rid, n in [("a", 5), ("b", 20), ("c", 30)]:
        sched.add_request(pooling_request(rid, n))
    results, steps = run_pooling(sched)
    assert steps == [{"a": 5, "b": 20}, {"c": 30}]
    assert results == {"a": [5], "b": [20], "c": [30]}
