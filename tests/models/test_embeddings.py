"""Embedding models through the engine: the real all-MiniLM-L6-v2 against sentence-transformers, and tiny
random Qwen3 decoders against pooling done on Hugging Face transformers' hidden states.

Tolerances:
- MiniLM, float32: cosine >= 0.9999 with sentence-transformers (the issue's bar). Both compute the same
  BERT in fp32; ours runs the linears on the flat token batch and attention padded per step, theirs on
  padded batches of 32, so only summation order differs (observed: cosine 1 - 1e-7).
- MiniLM, bfloat16 (what `--dtype auto` picks on CPUs with AVX512-BF16): cosine >= 0.999. bf16 keeps
  8 mantissa bits (relative step 0.4 %) and every matmul output is rounded; averaged over tokens and
  384 dimensions this costs ~1e-4 of cosine (observed min 0.99990), while a real bug (wrong position,
  mask, norm or pooling) drops cosine to < 0.9.
- tiny Qwen3, float32: max |difference| <= 1e-5 per coordinate of unit-norm vectors. Both sides are
  fp32; ours attends over a paged context (a gathered K/V for every chunk after the first), HF in one
  SDPA call, so values differ by summation order only (observed <= 3e-7).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedserve import LLM
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.setup import create_engine_config
from pagedserve.pooling_params import PoolingParams
from tests.models.real_models import packaged_model

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def square(x):\n    return x * x",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "Die Katze schläft auf dem Sofa.",
    "Le chat dort sur le canapé.",
    "你好，世界！北京是中国的首都。",
    "Emoji test: 😀 🚀 ✨ and numbers 1234567890, 3.14159, 42%.",
    "ok",
    "?!",
    "The mitochondria is the powerhouse of the cell, producing ATP through oxidative phosphorylation.",
    " ".join(["In the beginning the Universe was created."] * 12),  # ~110 tokens
    " ".join(["This sentence is longer than the model's 256-token limit and gets truncated."] * 25),
]
EMB_ATOL = 1e-5


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def vectors(outputs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outputs], dtype=np.float64)


# ---- encoder attention over a flat batch ---------------------------------------------------------------
@pytest.mark.parametrize("lengths", [[7], [4, 4, 4], [1, 5, 5, 17, 3, 40, 2], sorted([1, 5, 5, 17, 3, 40, 2])])
def test_encoder_attention_equals_each_sequence_alone(lengths):
    from pagedserve.models.bert import encoder_attention, encoder_metadata

    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 4, 8) for _ in range(3))
    ours = encoder_attention(q, k, v, encoder_metadata(lengths))
    start = 0
    for n in lengths:  # bidirectional: every token sees its whole sequence and nothing else
        rows = slice(start, start + n)
        alone = torch.nn.functional.scaled_dot_product_attention(*(x[rows].transpose(0, 1) for x in (q, k, v)))
        torch.testing.assert_close(ours[rows], alone.transpose(0, 1), atol=1e-6, rtol=0)
        start += n


def test_encoder_groups_limit_padding():
    from pagedserve.models.bert import encoder_metadata

    same = encoder_metadata([10, 10, 10])
    assert len(same.groups) == 1 and same.groups[0].padded_index is None  # a reshape, no padding
    mixed = encoder_metadata([2, 3, 3, 100])
    assert [g.seq_lens for g in mixed.groups] == [[2, 3, 3], [100]]  # the long one does not pad the short ones


# ---- all-MiniLM-L6-v2 (BERT encoder, mean pooling + normalize) --------------------------------------------
@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return packaged_model("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def minilm(minilm_dir) -> LLM:
    return LLM(str(minilm_dir), dtype="float32")


@pytest.fixture(scope="module")
def st_reference(minilm_dir) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    return model.encode(SENTENCES, convert_to_numpy=True).astype(np.float64)


def test_minilm_is_served_as_an_embedding_model(minilm):
    config = minilm.engine.config
    assert config.model.task == "embed"  # chosen from the architecture, no flag given
    assert (config.model.pooler.pooling_type, config.model.pooler.normalize) == ("mean", True)
    assert config.model.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    assert not config.scheduler.enable_chunked_prefill and not config.cache.enable_prefix_caching


def test_minilm_matches_sentence_transformers(minilm, st_reference):
    # sentence-transformers cuts inputs at max_seq_length (256); truncate_prompt_tokens=-1 does the same.
    outputs = minilm.embed(SENTENCES, truncate_prompt_tokens=-1)
    ours = vectors(outputs)
    assert ours.shape == (len(SENTENCES), 384)
    assert len(outputs[-1].prompt_token_ids) == 256 and outputs[-1].prompt_token_ids[-1] == 102  # [SEP] kept
    cos = cosines(ours, st_reference)
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_minilm_encode_and_unnormalised_vectors(minilm, minilm_dir):
    """LLM.encode (vLLM's pooling call) gives embed()'s vectors as tensors; normalize=False gives the pooled
    vector before sentence-transformers' Normalize module (its first two modules' output)."""
    from sentence_transformers import SentenceTransformer

    encoded = minilm.encode(SENTENCES[:3], pooling_task="embed")
    np.testing.assert_allclose(np.stack([o.outputs.data.numpy() for o in encoded]),
                               vectors(minilm.embed(SENTENCES[:3])), atol=1e-6)
    with pytest.raises(ValueError, match="pooling_task 'classify'"):
        minilm.encode(SENTENCES[:1], pooling_task="classify")
    raw = vectors(minilm.embed(SENTENCES[:3], PoolingParams(normalize=False)))
    pipeline = SentenceTransformer(str(minilm_dir), device="cpu")
    assert type(pipeline[2]).__name__ == "Normalize"
    with torch.inference_mode():
        features = pipeline[1](pipeline[0](pipeline.tokenize(SENTENCES[:3])))  # Transformer, then Pooling
    reference = features["sentence_embedding"].double().numpy()
    np.testing.assert_allclose(np.linalg.norm(raw, axis=1), np.linalg.norm(reference, axis=1), rtol=1e-4)
    assert cosines(raw, reference).min() >= 0.9999
    assert np.abs(np.linalg.norm(raw, axis=1) - 1.0).min() > 0.1  # really not unit length


def test_minilm_score_is_the_cosine_of_sentence_transformers_vectors(minilm, st_reference):
    """LLM.score (vLLM's, for an embedding model): one text against many, and pairs in order."""
    def cosine(i: int, j: int) -> float:
        a, b = st_reference[i], st_reference[j]
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

    one_to_many = minilm.score(SENTENCES[0], SENTENCES[1:4])
    assert [o.outputs.score for o in one_to_many] == pytest.approx([cosine(0, j) for j in (1, 2, 3)], abs=1e-4)
    assert one_to_many[1].prompt_token_ids == minilm.get_tokenizer().encode(SENTENCES[2])
    pairs = minilm.score(SENTENCES[:2], SENTENCES[2:4])
    assert [o.outputs.score for o in pairs] == pytest.approx([cosine(0, 2), cosine(1, 3)], abs=1e-4)
    with pytest.raises(ValueError, match="data_1 has 2 texts"):
        minilm.score(SENTENCES[:2], SENTENCES[:3])


def test_related_pair_scores_higher_than_unrelated(minilm):
    a, b, c = vectors(minilm.embed(["A man is eating food.", "A man is eating a piece of bread.",
                                    "A monkey is playing drums."]))
    assert a @ b > a @ c + 0.2


def test_minilm_batched_equals_one_at_a_time(minilm):
    texts = SENTENCES[:8]
    together = vectors(minilm.embed(texts))
    alone = np.concatenate([vectors(minilm.embed([t])) for t in texts])
    np.testing.assert_allclose(together, alone, atol=EMB_ATOL)


def test_minilm_token_ids_equal_text(minilm):
    ids = minilm.get_tokenizer().encode("A woman is playing violin.")
    from_text, from_ids, from_dict = minilm.embed(["A woman is playing violin.", ids, {"prompt_token_ids": ids}])
    assert from_text.outputs.embedding == from_ids.outputs.embedding == from_dict.outputs.embedding


def test_minilm_refuses_long_inputs_and_unsupported_dimensions(minilm):
    long_text = SENTENCES[-1]
    num_tokens = len(minilm.get_tokenizer().encode(long_text))
    with pytest.raises(ValueError, match=rf"maximum context length is 256 tokens.*{num_tokens} tokens"):
        minilm.embed(long_text)
    with pytest.raises(ValueError, match="Matryoshka"):
        minilm.embed("hi", PoolingParams(dimensions=128))
    with pytest.raises(ValueError, match="embedding model"):
        minilm.generate("hi")
    with pytest.raises(ValueError, match="this model embeds"):  # not "the tokenizer has no chat template"
        minilm.chat([{"role": "user", "content": "hi"}])
    assert not minilm.engine.has_unfinished_requests()


def test_minilm_frees_every_block(minilm):
    minilm.embed(SENTENCES[:10])
    pool = minilm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert not minilm.engine.scheduler.kv.req_to_blocks and not minilm.engine.runner.pooler.partials


def test_minilm_bfloat16_close_to_sentence_transformers(minilm_dir, st_reference):
    llm = LLM(str(minilm_dir), dtype="bfloat16")
    cos = cosines(vectors(llm.embed(SENTENCES, truncate_prompt_tokens=-1)), st_reference)
    assert cos.min() >= 0.999, cos


@pytest.mark.parametrize("kwargs,min_cosine", [
    ({"dtype": "float32", "reference_kernels": True}, 0.9999),  # plain F.linear instead of oneDNN-packed
    # Weight-only int8, one scale per output channel: each weight off by up to half a step (0.4 % of the
    # row's largest); observed min cosine 0.9966, a broken kernel gives < 0.5.
    ({"dtype": "float32", "quantization": "int8"}, 0.99),
])
def test_minilm_other_kernels(minilm_dir, st_reference, kwargs, min_cosine):
    llm = LLM(str(minilm_dir), **kwargs)
    cos = cosines(vectors(llm.embed(SENTENCES, truncate_prompt_tokens=-1)), st_reference)
    assert cos.min() >= min_cosine, cos


# ---- tiny random Qwen3 decoders as embedders ---------------------------------------------------------------
def prompts_of(lengths: list[int], vocab_size: int = 512) -> list[list[int]]:
    return [[(31 * i + 7 * j) % (vocab_size - 3) + 3 for j in range(n)] for i, n in enumerate(lengths)]


LENGTHS = [1, 5, 17, 40, 100]  # budget 32: 40 and 100 run as chunked prefills


def hf_hidden_states(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The last layer's (final-norm) hidden states [n, hidden] of each prompt, run alone in transformers."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir) -> str:
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def qwen3_embedder(qwen3_dir) -> LLM:
    return LLM(qwen3_dir, task="embed", dtype="float32", max_num_batched_tokens=32, block_size=4)


def test_qwen3_last_token_pooling_matches_hf(qwen3_embedder, qwen3_dir):
    config = qwen3_embedder.engine.config
    assert (config.model.pooler.pooling_type, config.model.pooler.normalize) == ("lasttoken", True)
    assert config.scheduler.enable_chunked_prefill and config.cache.enable_prefix_caching
    prompts = prompts_of(LENGTHS)
    ours = torch.tensor(vectors(qwen3_embedder.embed(prompts)), dtype=torch.float32)
    reference = torch.stack([torch.nn.functional.normalize(h[-1], dim=0) for h in hf_hidden_states(qwen3_dir, prompts)])
    torch.testing.assert_close(ours, reference, atol=EMB_ATOL, rtol=0)


def test_qwen3_batched_equals_one_at_a_time(qwen3_embedder):
    prompts = prompts_of(LENGTHS)
    together = vectors(qwen3_embedder.embed(prompts))
    alone = np.concatenate([vectors(qwen3_embedder.embed([p])) for p in prompts])
    np.testing.assert_allclose(together, alone, atol=EMB_ATOL)


def test_qwen3_prefix_cache_hit_gives_the_same_vector(qwen3_embedder):
    kv = qwen3_embedder.engine.scheduler.kv
    shared = prompts_of([60])[0]
    first = vectors(qwen3_embedder.embed([shared + [9, 10]]))
    hits_before = kv.stats.num_hits
    second = vectors(qwen3_embedder.embed([shared + [9, 10]]))
    assert kv.stats.num_hits > hits_before  # the second run skipped the cached prefix
    np.testing.assert_allclose(first, second, atol=EMB_ATOL)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1  # cached blocks are free (evictable) once done


def test_qwen3_abort_mid_prompt_frees_everything(qwen3_embedder):
    engine = qwen3_embedder.engine
    engine.add_request("long", prompts_of([100])[0], PoolingParams())
    assert engine.step() == []  # the first 32-token chunk: nothing to report yet
    assert "long" in engine.runner.pooler.partials
    (final,) = engine.abort_request(["long"])
    assert final.finished and final.outputs.embedding == []
    engine.step()  # the runner learns of the abort at the next step
    assert not engine.runner.pooler.partials and not engine.has_unfinished_requests()
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks - 1


def copy_with_sentence_transformers_files(source: str, target: Path, pooling_mode: str, normalize: bool) -> str:
    shutil.copytree(source, target)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (target / "modules.json").write_text(json.dumps(modules))
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                  "pooling_mode": pooling_mode}))
    return str(target)


@pytest.mark.parametrize("mode,normalize", [("mean", True), ("cls", False), ("max", True), ("weightedmean", True),
                                            ("mean_sqrt_len_tokens", False), ("lasttoken", False)])
def test_pooling_modes_match_sentence_transformers_pooling(qwen3_dir, tmp_path, mode, normalize):
    """Every mode, read from sentence-transformers files (task chosen automatically), across chunked
    prefills (budget 16), against sentence-transformers' own Pooling module on HF hidden states."""
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Pooling

    model_dir = copy_with_sentence_transformers_files(qwen3_dir, tmp_path / "model", mode, normalize)
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=16, block_size=4)
    assert llm.engine.config.model.task == "embed"
    assert llm.engine.config.cache.enable_prefix_caching == (mode == "lasttoken")
    prompts = prompts_of(LENGTHS)
    ours = torch.tensor(vectors(llm.embed(prompts)), dtype=torch.float32)
    pooling = Pooling(64, pooling_mode=mode)
    reference = torch.cat([pooling({"token_embeddings": h[None], "attention_mask": torch.ones(1, len(h))}
                                   )["sentence_embedding"] for h in hf_hidden_states(model_dir, prompts)])
    normalized = torch.nn.functional.normalize(reference, dim=1)
    torch.testing.assert_close(ours, normalized if normalize else reference,
                               atol=EMB_ATOL * max(1.0, float(reference.abs().max())), rtol=0)
    # A request's `normalize` (vLLM's) overrides the model's Normalize module either way.
    flipped = torch.tensor(vectors(llm.embed(prompts, PoolingParams(normalize=not normalize))), dtype=torch.float32)
    torch.testing.assert_close(flipped, reference if normalize else normalized,
                               atol=EMB_ATOL * max(1.0, float(reference.abs().max())), rtol=0)


def test_qwen3_model_checkpoint_layout_is_an_embedder(qwen3_dir, qwen3_embedder, tmp_path):
    """Qwen3-Embedding is saved as the base Qwen3Model: no `model.` prefix, no LM head; served as embed."""
    from transformers import AutoModel

    base_dir = tmp_path / "qwen3-base"
    AutoModel.from_pretrained(qwen3_dir, dtype=torch.float32).save_pretrained(base_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(qwen3_dir) / name, base_dir / name)
    assert json.loads((base_dir / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    llm = LLM(str(base_dir), dtype="float32")
    prompts = prompts_of([3, 33])
    np.testing.assert_allclose(vectors(llm.embed(prompts)), vectors(qwen3_embedder.embed(prompts)), atol=EMB_ATOL)


def test_matryoshka_dimensions_truncate_and_renormalise(tiny_model_dir):
    llm = LLM(tiny_model_dir("qwen3", is_matryoshka=True), runner="pooling", dtype="float32")
    prompt = prompts_of([12])
    full = np.array(llm.embed(prompt)[0].outputs.embedding)
    short = np.array(llm.embed(prompt, PoolingParams(dimensions=16))[0].outputs.embedding)
    assert short.shape == (16,)
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    with pytest.raises(ValueError, match="between 1 and"):
        llm.embed(prompt, PoolingParams(dimensions=65))


def test_task_and_runner_flags(qwen3_dir, tmp_path):
    assert create_engine_config(EngineArgs(model=qwen3_dir)).model.task == "generate"
    assert create_engine_config(EngineArgs(model=qwen3_dir, runner="pooling")).model.task == "embed"
    assert create_engine_config(EngineArgs(model=qwen3_dir, task="embed")).model.task == "embed"
    with pytest.raises(ValueError, match="contradicts"):
        create_engine_config(EngineArgs(model=qwen3_dir, task="generate", runner="pooling"))
    # vLLM's way to serve a generative model as an embedder (its --task embed is deprecated)
    config = create_engine_config(EngineArgs(model=qwen3_dir, runner="pooling", convert="embed"))
    assert config.model.task == "embed"
    assert create_engine_config(EngineArgs(model=qwen3_dir, convert="embed")).model.task == "embed"
    assert create_engine_config(EngineArgs(model=qwen3_dir, convert="none")).model.task == "generate"
    with pytest.raises(ValueError, match="--convert embed contradicts --runner generate"):
        create_engine_config(EngineArgs(model=qwen3_dir, runner="generate", convert="embed"))
    with pytest.raises(ValueError, match="--convert classify is not supported"):
        create_engine_config(EngineArgs(model=qwen3_dir, convert="classify"))
    with pytest.raises(ValueError, match="--task embed"):
        create_engine_config(EngineArgs(model=str(packaged_model("all-minilm-l6-v2")), task="generate"))
    with pytest.raises(ValueError, match="cannot embed"):
        LLM(qwen3_dir, dtype="float32", max_model_len=64).embed("hello")


def test_building_a_model_never_imports_torch_dynamo(minilm_dir, tiny_model_dir):
    """Initialising layers on the meta device imports torch._dynamo (and triton where installed): BERT's layers
    took that path, ~0.8 s of loading and 234 MiB of the server's RSS (584 -> 350 MiB for MiniLM)."""
    import subprocess
    import sys

    code = ("import sys; from pagedserve.entrypoints.llm import LLM; "
            "[LLM(m, dtype='float32', max_model_len=128) for m in sys.argv[1:]]; "
            "print(sorted(n for n in ('torch._dynamo', 'triton') if n in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, str(minilm_dir), tiny_model_dir("llama")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
