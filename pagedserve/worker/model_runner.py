"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples. Knows nothing of queues.

Per-request state (block table row, sampling generator, penalty counts) lives here between steps.
The batch is ordered decodes first (one token each), then prefill chunks; see layers/attention.py.

Speculative decoding: a request with draft tokens (SchedulerOutput.spec_token_ids) computes its last token and
the drafts as consecutive decode rows of its own sequence, each attending to the positions before it (every
row's K/V is written before any row attends), so verification runs on the decode kernels and the native decode
stack. Each row is sampled as that position would be one token per step (penalties, min_tokens, grammar and
seeded generator as if the drafts before it were accepted); drafts are accepted while they equal the sampled
token, and the sampled token after the last accepted one is emitted too. With one-hot drafts this is exact
rejection sampling: a draft d is kept with probability p(d), and a rejected row's token is drawn from p
without d, so the output distribution is the one without speculation, and greedy output the same tokens.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedserve.layers.attention import FP8_DTYPES, AttentionMetadata, LayerKVCache, PrefillSpan
from pagedserve.layers.linear import warm_up_rows
from pagedserve.layers.sampler import Penalties, Sampler, SamplerOutput, SamplingBatch, top_logprobs
from pagedserve.memory.pressure import release_block_pages
from pagedserve.models.loader import ProgressFn, load_model
from pagedserve.platform import lazy_zeros, torch_dtype
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.acceptance import accepted_tokens
from pagedserve.structured.gate import GatedGrammar
from pagedserve.structured.matcher import RequestGrammar
from pagedserve.worker.draft_model import DraftModel

logger = logging.getLogger(__name__)


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-k (ids may repeat it)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    row: int  # row of the persistent block table
    num_output_tokens: int
    generator: torch.Generator | None = None
    output_counts: torch.Tensor | None = None  # [V] for penalties
    prompt_mask: torch.Tensor | None = None  # [V] for the repetition penalty
    num_prompt_logprobs_done: int = 0
    grammar: RequestGrammar | GatedGrammar | None = None  # a constrained request's matcher (kept across preemption)
    recent_output: list[int] | None = None  # with bad_words: the output's last tokens, as many as a word's prefix


@dataclass
class _Batch:
    """Tensors and bookkeeping for one forward pass."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    request_ids: list[str]  # batch order
    sample_rows: list[int]  # rows to sample: a request's last token's row, or a verification's rows
    sample_request_ids: list[str]  # the request of each sampled row (repeated for a verification)
    spans: dict[str, tuple[int, int, int]]  # request_id -> (first row, num tokens, start position)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request_id -> drafts its rows can verify


def _runs(request_ids: list[str]) -> list[tuple[str, int]]:
    """(request id, consecutive rows) for each request in the sampled rows, in order."""
    return [(request_id, len(list(rows))) for request_id, rows in itertools.groupby(request_ids)]


def _bad_words_memory(params: SamplingParams) -> int:
    """How many of the output's last tokens bad_words need: the longest word's tokens before its last (1 at least,
    so that the tail is never cut to nothing by del [:-0])."""
    return max(1, max(len(ids) for ids in params.bad_words_token_ids) - 1)


def _bad_word_ends(words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens banned next (vLLM's bad_words): each word's last token where the output ends with the tokens
    before it (a one-token word always)."""
    banned = []
    for ids in words:
        prefix = ids[:-1]
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            banned.append(ids[-1])
    return list(dict.fromkeys(banned))


def _row_offsets(request_ids: list[str]) -> list[int]:
    """For each sampled row, how many rows of the same request come before it (drafts ahead of it)."""
    return [offset for _, num in _runs(request_ids) for offset in range(num)]


def make_kv_pools(model, num_slots: int, kv_dtype: torch.dtype, dtype: torch.dtype,
                  device: torch.device, num_window_slots: int | None = None) -> list[LayerKVCache]:
    """One K/V pool per decoder layer of `model`, `num_slots` token slots each (an fp8 pool with its scales);
    `num_window_slots` for the layers with a sliding window where they have a pool of their own."""
    quantized = kv_dtype in FP8_DTYPES.values()
    # Masked attention still multiplies unused slots by 0, so every slot must start finite: zeros,
    # allocated lazily so that the pool costs RAM only as it fills.
    pools = []
    for layer in range(model.num_layers):
        windowed = num_window_slots is not None and model.layer_windows[layer] is not None
        shape = (num_window_slots if windowed else num_slots, model.num_kv_heads, model.head_dim)
        cache = LayerKVCache(lazy_zeros(shape, kv_dtype, device), lazy_zeros(shape, kv_dtype, device))
        if quantized:
            scale_shape = (shape[0], model.num_kv_heads, 1)
            cache.k_scale = lazy_zeros(scale_shape, dtype, device)
            cache.v_scale = lazy_zeros(scale_shape, dtype, device)
        pools.append(cache)
    return pools


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, progress: ProgressFn | None = None,
                 eos_token_id: int | None = None, tp=None, extra_eos_token_ids: Sequence[int] = ()) -> None:
        """`tp`: this rank's distributed TPGroup; the model is then its shard (worker/tp_worker.py).
        `extra_eos_token_ids`: generation_config.json's EOS ids beyond the tokenizer's."""
        self.config = config
        self.tp = tp
        self.eos_token_id = eos_token_id  # the tokenizer's: a grammar may end on it
        # What min_tokens bans besides a request's stop ids: every EOS, with ignore_eos too (vLLM's
        # all_stop_token_ids); without ignore_eos the extra ones are among the request's stop ids already.
        self.min_tokens_eos_ids = [t for t in (eos_token_id, *extra_eos_token_ids) if t is not None]
        self.device = config.device.device
        self.dtype = torch_dtype(config.model.dtype)
        self.block_size = config.cache.block_size
        self.model = self._load_model(hf_config, progress)
        self.vocab_size = hf_config.vocab_size
        self.kv_caches: list[LayerKVCache] = []
        max_rows = config.scheduler.max_num_seqs
        self.max_blocks_per_seq = -(-config.model.max_model_len // self.block_size)
        self.block_table = torch.zeros((max_rows, self.max_blocks_per_seq), dtype=torch.int64)
        # The sliding-window layers' own block table where they have a pool of their own (kv_cache_manager.py).
        self.window_block_table = torch.zeros_like(self.block_table) if config.cache.num_window_blocks else None
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.states: dict[str, RequestState] = {}
        generator = torch.Generator(device=self.device)
        if config.model.seed is not None:  # None (vLLM's): unseeded, a different draw each start
            generator.manual_seed(config.model.seed)
        else:
            generator.seed()
        self.sampler = Sampler(generator, native=self.model.kernel_backend.native)
        self.draft: DraftModel | None = None  # speculative decoding's draft model (method draft_model)
        if config.draft_model is not None:
            self.draft = DraftModel(config, progress)

    def _load_model(self, hf_config, progress: ProgressFn | None):
        """This process's model (rank 0's shard under tensor parallelism; worker/tp_worker.py wraps it)."""
        config = self.config
        return load_model(hf_config, config.model.architecture, config.model.model, self.dtype, self.device,
                          config.model.max_model_len, progress, quantization=config.model.quantization,
                          reference_kernels=config.model.reference_kernels, task=config.model.task, tp=self.tp)

    def warm_up_rows(self) -> int:
        return warm_up_rows(self.model)

    def check_health(self) -> None:
        """Nothing to check: the model runs in this process."""

    def kernel_report(self) -> list[str]:
        return self.model.kernel_report()

    # ---- memory ----------------------------------------------------------------------------
    def kv_dtype(self) -> torch.dtype:
        name = self.config.cache.kv_cache_dtype
        if name == "auto":
            return self.dtype
        return FP8_DTYPES[name] if name in FP8_DTYPES else torch_dtype(name)

    def allocate_kv_cache(self) -> None:
        num_slots = self.config.cache.num_blocks * self.block_size
        num_window_slots = self.config.cache.num_window_blocks * self.block_size or None
        self.kv_caches = make_kv_pools(self.model, num_slots, self.kv_dtype(), self.dtype, self.device,
                                       num_window_slots)
        if self.draft is not None:  # its pools are indexed by the same block table
            self.draft.kv_caches = make_kv_pools(self.draft.model, num_slots, self.kv_dtype(), self.dtype, self.device)

    def kv_pools(self) -> list[LayerKVCache]:
        """The target's pools, then the draft model's (the same block ids index both)."""
        return self.kv_caches + (self.draft.kv_caches if self.draft is not None else [])

    def release_kv_pages(self, block_ids: list[int], block_size: int, window_block_ids: list[int] = ()) -> int:
        """Runner protocol: these free blocks' pages in every pool of this process (`window_block_ids`: the
        window pool's, in the sliding-window layers' pools where they have their own)."""
        if self.window_block_table is None:
            return release_block_pages(self.kv_pools(), block_ids, block_size)
        windowed = [window is not None for window in self.model.layer_windows]
        full = [cache for cache, w in zip(self.kv_caches, windowed) if not w]
        window = [cache for cache, w in zip(self.kv_caches, windowed) if w]
        return (release_block_pages(full, block_ids, block_size)
                + release_block_pages(window, list(window_block_ids), block_size))

    # ---- request state ---------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids:
            state = self.states.pop(request_id, None)
            if state is not None and state.row >= 0:
                self.free_rows.append(state.row)
            if self.draft is not None:
                self.draft.kv.forget(request_id)
        for request_id in sched.preempted_request_ids:
            state = self.states[request_id]
            self.free_rows.append(state.row)
            state.row, state.block_ids = -1, []
            if self.draft is not None:
                self.draft.kv.forget(request_id)
        for new in sched.new_requests:
            self._add_request(new)
            if self.draft is not None:
                self.draft.kv.admit(new.request_id, new.token_ids, new.num_computed_tokens, new.block_ids)
        for cached in sched.cached_requests:
            state = self.states[cached.request_id]
            if cached.new_block_ids:
                start = len(state.block_ids)
                state.block_ids.extend(cached.new_block_ids)
                self.block_table[state.row, start:start + len(cached.new_block_ids)] = torch.tensor(
                    cached.new_block_ids, dtype=torch.int64)
            if cached.new_window_block_ids:  # the window table is as long as the main one (kv_cache_manager.py)
                end = len(state.block_ids)
                self.window_block_table[state.row, end - len(cached.new_window_block_ids):end] = torch.tensor(
                    cached.new_window_block_ids, dtype=torch.int64)

    def _add_request(self, new: NewRequestData) -> None:
        state = self.states.get(new.request_id)  # present when resuming after preemption
        if state is None:
            state = RequestState(new.request_id, new.token_ids[:new.num_prompt_tokens], new.sampling_params,
                                 [], -1, len(new.token_ids) - new.num_prompt_tokens)
            self._init_sampling_state(state, new.grammar, new.token_ids[new.num_prompt_tokens:])
            self.states[new.request_id] = state
        state.row = self.free_rows.pop()
        state.block_ids = list(new.block_ids)
        self.block_table[state.row, :len(new.block_ids)] = torch.tensor(new.block_ids, dtype=torch.int64)
        if new.window_block_ids:
            self.window_block_table[state.row, :len(new.window_block_ids)] = torch.tensor(new.window_block_ids,
                                                                                          dtype=torch.int64)

    def _init_sampling_state(self, state: RequestState, grammar: object = None, output: Sequence[int] = ()) -> None:
        """`output`: the tokens the request generated before (one resumed after preemption)."""
        params = state.sampling_params
        if params.bad_words_token_ids:
            state.recent_output = list(output[-_bad_words_memory(params):]) if output else []
        if grammar is not None:
            stop_ids = list(params.stop_token_ids)
            if self.eos_token_id is not None:
                stop_ids.insert(0, self.eos_token_id)
            state.grammar = RequestGrammar(grammar, stop_ids)
            if params.reasoning_gate is not None:
                state.grammar = GatedGrammar(state.grammar, params.reasoning_gate)
        if params.seed is not None:
            state.generator = torch.Generator(device=self.device)
            state.generator.manual_seed(params.seed)
        if params.has_penalties:
            state.output_counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
            state.prompt_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            ids = torch.tensor(state.prompt_token_ids, dtype=torch.int64, device=self.device)
            state.prompt_mask[ids[ids < self.vocab_size]] = True

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        batch = self._prepare(sched)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)  # [T, H]
        held = self._follow_draft(sched, batch) if self.draft is not None else None
        out = ModelRunnerOutput()
        self._prompt_logprobs(sched, batch, hidden, out)
        if batch.sample_rows:
            rows = torch.tensor(batch.sample_rows, device=self.device)
            logits = self.model.compute_logits(hidden[rows])  # [rows, V] float32
            sampling = self._sampling_batch(batch.sample_request_ids, batch.drafts)
            self._collect_samples(batch, self.sampler(logits, sampling), out)
        if held is not None:  # a decode-only step's follow, once the target has said which rows it keeps
            self._follow_rows(batch, held, out.sampled_token_ids)
        if batch.sample_rows and self.draft is not None:
            self._propose_drafts(sched, batch, out)
        return out

    def _follow_draft(self, sched: SchedulerOutput, batch: _Batch) -> dict[str, int] | None:
        """The draft model's K/V follow the target's (the same tokens at the same slots) in every step where a
        request speculates; a step where none does is skipped, and each lagging request of the next followed
        step is caught up first (worker/draft_model.py). A step with prefills is followed here; a decode-only
        step's rows are left to `_follow_rows` after sampling: returns where each request's held positions end
        for it (None: nothing left to follow)."""
        kv = self.draft.kv
        spans = [(request_id, start, start + num) for request_id, (_, num, start) in batch.spans.items()]
        held = {request_id: kv.step(request_id, start, sched.scheduled_token_ids[request_id])
                for request_id, start, _ in spans}
        kv.proposed.clear()  # a proposal holds only for its request's next step
        if not sched.lookahead:
            for request_id, start, end in spans:
                kv.skipped(request_id, start, end, self.states[request_id].block_ids)
            return None
        firsts = {}
        for request_id, start, _ in spans:
            firsts[request_id], missing = kv.catch_up(request_id, start)
            if missing:
                self._draft_prefill(self.states[request_id].row, firsts[request_id], missing)
        for request_id, _, end in spans:  # a decode-only step's rows are computed after sampling, in this step
            kv.followed(request_id, firsts[request_id], end, self.states[request_id].block_ids)
        if batch.meta.prefills:
            self.draft.follow(batch.input_ids, batch.positions, batch.meta)
            return None
        return held

    def _follow_rows(self, batch: _Batch, held: dict[str, int], sampled: dict[str, list[int]]) -> None:
        """A decode-only step's follow: the draft model runs only the rows whose K/V the next proposal needs and
        the last one did not write.
        - Held rows (`held`: where each request's run of them ends, DraftKV.step) are left out: a verification's
          rows but the last are the last token and the drafts, which the proposal fed at the same positions.
        - Rows past the tokens the target kept (`sampled`: a rejected draft's position, with the first rejected
          draft as input) are left out too: the next step starts there, and DraftKV.step then stops counting
          them as valid. So after a partial acceptance nothing is left to run."""
        index, rows = [], []
        for request_id, (first, num, start) in batch.spans.items():
            skip = held[request_id] - start
            kept = min(num, len(sampled[request_id])) if request_id in sampled else num
            self.draft.kv.num_held_tokens += skip
            self.draft.kv.num_dropped_tokens += max(0, num - max(skip, kept))
            index += range(first + skip, first + kept)
            rows += [self.states[request_id].row] * max(0, kept - skip)
        if len(index) == batch.input_ids.shape[0]:
            self.draft.follow(batch.input_ids, batch.positions, batch.meta)
        elif index:
            picked = torch.tensor(index, dtype=torch.int64)
            positions = batch.positions.cpu()[picked]
            meta = self._decode_step_meta(torch.tensor(rows, dtype=torch.int64), positions)
            self.draft.follow(batch.input_ids[picked.to(self.device)], positions.to(self.device), meta)

    def _draft_prefill(self, row: int, first: int, tokens: list[int]) -> None:
        """The draft model's K/V of `tokens` at positions first.. of block-table row `row`, in chunks of at most
        max_num_batched_tokens (a request's catch-up after steps that did not follow)."""
        budget = self.config.scheduler.max_num_batched_tokens
        for offset in range(0, len(tokens), budget):
            chunk = tokens[offset:offset + budget]
            start = first + offset
            positions = torch.arange(start, start + len(chunk), dtype=torch.int64)
            meta = AttentionMetadata(slot_mapping=self._slot_mapping(torch.full_like(positions, row), positions)
                                     .to(self.device))
            meta.prefills.append(self._prefill_span(row, 0, len(chunk), start))
            self.draft.follow(torch.tensor(chunk, dtype=torch.int64, device=self.device), positions.to(self.device),
                              meta)

    def _propose_drafts(self, sched: SchedulerOutput, batch: _Batch, out: ModelRunnerOutput) -> None:
        """The draft model's next tokens for each request sampled this step that the scheduler gave lookahead
        slots (its decision of who speculates, and how many drafts: one per slot)."""
        starts = []  # (request_id, block-table row, last token, its position, drafts to propose)
        for request_id, (_, num, start) in batch.spans.items():  # batch order: the same rows every run
            tokens = out.sampled_token_ids.get(request_id)
            state = self.states[request_id]
            length = sched.lookahead.get(request_id, 0)
            if not length or not tokens or request_id in out.grammar_finished:
                continue
            limit = state.sampling_params.max_tokens  # None: up to max_model_len (the scheduler's lookahead ends there)
            if limit is not None and state.num_output_tokens >= limit:
                continue  # it ends with this step
            verified = request_id in batch.drafts
            if verified and len(tokens) == 1:
                continue  # none of its drafts accepted: the scheduler backs it off and would drop these drafts
            # The rows whose K/V hold known tokens: all of them, or a verification's accepted part.
            position = start + (len(tokens) if verified else num)
            length = min(length, len(state.block_ids) * self.block_size - position)  # room for their K/V
            if length > 0:
                starts.append((request_id, state.row, tokens[-1], position, length))
        if starts:
            out.draft_token_ids = self.draft.propose(starts, self._decode_step_meta)

    def _slot_mapping(self, rows: torch.Tensor, positions: torch.Tensor, table: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """The KV slot of each (block-table row, position) in `table` (the main block table by default)."""
        table = self.block_table if table is None else table
        return table[rows, positions // self.block_size] * self.block_size + positions % self.block_size

    def _decode_step_meta(self, rows: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
        """Metadata of a decode-only batch: block-table rows `rows`, one token each at `positions`."""
        def build(table: torch.Tensor) -> AttentionMetadata:
            meta = AttentionMetadata(slot_mapping=self._slot_mapping(rows, positions, table).to(self.device),
                                     num_decodes=int(rows.shape[0]))
            self._decode_meta(meta, rows, positions + 1, table)
            return meta

        return self._with_window_meta(build)

    def _with_window_meta(self, build: Callable[[torch.Tensor], AttentionMetadata]) -> AttentionMetadata:
        """`build(table)`'s metadata from the main block table, with the sliding-window layers' own from theirs
        where they have a pool of their own (AttentionMetadata.window_meta)."""
        meta = build(self.block_table)
        if self.window_block_table is not None:
            meta.window_meta = build(self.window_block_table)
        return meta

    def _prepare(self, sched: SchedulerOutput) -> _Batch:
        # Decode rows: single-token decodes and verifications (a request's last token and its drafts).
        decodes = [r for r, n in sched.num_scheduled_tokens.items() if n == 1 or r in sched.spec_token_ids]
        prefills = [r for r, n in sched.num_scheduled_tokens.items() if n > 1 and r not in sched.spec_token_ids]
        order = decodes + prefills
        token_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        spans: dict[str, tuple[int, int, int]] = {}
        sample_rows, sample_ids = [], []
        drafts: dict[str, list[int]] = {}
        num_decode_rows = 0
        num_computed = {c.request_id: c.num_computed_tokens for c in sched.cached_requests}
        num_computed.update((n.request_id, n.num_computed_tokens) for n in sched.new_requests)
        for request_id in order:
            state = self.states[request_id]
            chunk = sched.scheduled_token_ids[request_id]
            start = num_computed[request_id]
            spans[request_id] = (len(token_ids), len(chunk), start)
            token_ids.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
            rows.extend([state.row] * len(chunk))
            if request_id in sched.spec_token_ids:
                spec = sched.spec_token_ids[request_id]
                valid = state.grammar.num_valid_drafts(spec) if state.grammar is not None else len(spec)
                drafts[request_id] = spec[:valid]
                first = len(token_ids) - len(chunk)
                sample_rows.extend(range(first, first + 1 + valid))
                sample_ids.extend([request_id] * (1 + valid))
            elif sched.needs_sample[request_id]:
                sample_rows.append(len(token_ids) - 1)
                sample_ids.append(request_id)
            if len(spans) == len(decodes):  # decodes come first: this was the last of them
                num_decode_rows = len(token_ids)
        pos = torch.tensor(positions, dtype=torch.int64)
        row_t = torch.tensor(rows, dtype=torch.int64)

        def build(table: torch.Tensor) -> AttentionMetadata:
            meta = AttentionMetadata(slot_mapping=self._slot_mapping(row_t, pos, table).to(self.device),
                                     num_decodes=num_decode_rows)
            if decodes:  # each decode row attends to its own position and those before it
                self._decode_meta(meta, row_t[:num_decode_rows], pos[:num_decode_rows] + 1, table)
            for request_id in prefills:
                first, num, start = spans[request_id]
                meta.prefills.append(self._prefill_span(self.states[request_id].row, first, num, start, table))
            return meta

        meta = self._with_window_meta(build)
        return _Batch(torch.tensor(token_ids, dtype=torch.int64, device=self.device), pos.to(self.device),
                      meta, order, sample_rows, sample_ids, spans, drafts)

    def _context_slots(self, rows: torch.Tensor, max_len: int, table: torch.Tensor | None = None) -> torch.Tensor:
        """[R, max_len] slot of each context position for rows `rows` of `table` (the main block table by
        default)."""
        num_blocks = -(-max_len // self.block_size)
        blocks = (self.block_table if table is None else table)[rows, :num_blocks]  # [R, nb]
        offsets = torch.arange(self.block_size, dtype=torch.int64)
        slots = (blocks.unsqueeze(-1) * self.block_size + offsets).view(rows.shape[0], -1)
        return slots[:, :max_len]

    def _decode_meta(self, meta: AttentionMetadata, rows: torch.Tensor, context_lens: torch.Tensor,
                     table: torch.Tensor | None = None) -> None:
        max_len = int(context_lens.max())
        meta.decode_kv_slots = self._context_slots(rows, max_len, table).contiguous().to(self.device)
        meta.decode_context_lens = context_lens.to(self.device)

    def _prefill_span(self, row: int, first: int, num: int, start: int, table: torch.Tensor | None = None
                      ) -> PrefillSpan:
        span = PrefillSpan(first, first + num, context_start=start)
        if start == 0:
            return span  # no prior context: attend within the chunk, causally
        span.kv_slots = self._context_slots(torch.tensor([row]), start + num, table)[0].to(self.device)
        return span

    # ---- sampling --------------------------------------------------------------------------
    def _sampling_batch(self, request_ids: list[str], drafts: dict[str, list[int]]) -> SamplingBatch:
        """Settings of each sampled row; a verification's i-th row samples as if its first i drafts were
        accepted (its min_tokens count, penalties and grammar state include them)."""
        states = [self.states[r] for r in request_ids]
        offsets = _row_offsets(request_ids)
        params = [s.sampling_params for s in states]
        temperature = torch.tensor([0.0 if p.is_greedy else p.temperature for p in params],
                                   dtype=torch.float32, device=self.device)
        batch = SamplingBatch(temperature=temperature, all_greedy=all(p.is_greedy for p in params))
        if not batch.all_greedy:
            if any(p.top_k > 0 for p in params):
                batch.top_k = torch.tensor([p.top_k for p in params], device=self.device)
            if any(p.top_p < 1.0 for p in params):
                batch.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device)
            if any(p.min_p > 0.0 for p in params):
                batch.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=self.device)
            batch.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
            batch.checkpoint_rows = {i for i in batch.generators if request_ids[i] in drafts}
        for i, (state, p, offset) in enumerate(zip(states, params, offsets)):
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=self.device)
                values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=self.device)
                batch.logit_bias.append((i, ids, values))
            if p.allowed_token_ids:
                batch.allowed.append((i, torch.tensor(p.allowed_token_ids, dtype=torch.int64, device=self.device)))
            if state.recent_output is not None:
                ahead = drafts[state.request_id][:offset] if offset else []
                bad = _bad_word_ends(p.bad_words_token_ids, state.recent_output + ahead)
                if bad:
                    batch.logit_bias.append((i, torch.tensor(bad, dtype=torch.int64, device=self.device),
                                             torch.full((len(bad),), float("-inf"), device=self.device)))
            if state.num_output_tokens + offset < p.min_tokens:
                banned = list(dict.fromkeys([*p.stop_token_ids, *self.min_tokens_eos_ids]))
                if banned:
                    batch.banned.append((i, torch.tensor(banned, dtype=torch.int64, device=self.device)))
            if p.logprobs is not None:
                batch.max_num_logprobs = max(batch.max_num_logprobs, p.logprobs)
            if state.grammar is not None:
                grammar = state.grammar.at(drafts[state.request_id][:offset] if offset else [])
                if grammar is not None:  # None: a row inside a think block the grammar waits for (gate.py)
                    batch.grammars.append((i, grammar))
        batch.penalties = self._penalties(states, offsets, drafts)
        return batch

    def _penalties(self, states: list[RequestState], offsets: list[int], drafts: dict[str, list[int]]
                   ) -> Penalties | None:
        rows = [i for i, s in enumerate(states) if s.output_counts is not None]
        if not rows:
            return None
        picked = [states[i] for i in rows]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=self.device).unsqueeze(1)

        counts = []
        for i, state in zip(rows, picked):
            count = state.output_counts
            if offsets[i]:  # a verification row: the drafts before it count as output
                ahead = torch.tensor(drafts[state.request_id][:offsets[i]], dtype=torch.int64, device=self.device)
                count = count + torch.bincount(ahead, minlength=self.vocab_size)[:self.vocab_size].float()
            counts.append(count)
        return Penalties(
            rows=torch.tensor(rows, device=self.device),
            output_counts=torch.stack(counts),
            prompt_mask=torch.stack([s.prompt_mask for s in picked]),
            presence=column([s.sampling_params.presence_penalty for s in picked]),
            frequency=column([s.sampling_params.frequency_penalty for s in picked]),
            repetition=column([s.sampling_params.repetition_penalty for s in picked]))

    def _collect_samples(self, batch: _Batch, sampled: SamplerOutput, out: ModelRunnerOutput) -> None:
        token_ids = sampled.token_ids.tolist()  # the one host sync of the step
        wants_logprobs = sampled.token_logprobs is not None
        if wants_logprobs:
            token_lps = sampled.token_logprobs.tolist()
            ranks = sampled.token_ranks.tolist()
            top_ids = sampled.top_ids.tolist()
            top_lps = sampled.top_logprobs.tolist()
        first = 0
        for request_id, num_rows in _runs(batch.sample_request_ids):
            state = self.states[request_id]
            rows = range(first, first + num_rows)
            first += num_rows
            emitted = accepted_tokens([token_ids[row] for row in rows], batch.drafts.get(request_id, []))
            if state.generator is not None and request_id in batch.drafts and sampled.generator_states:
                state.generator.set_state(sampled.generator_states[rows[len(emitted) - 1]])  # as if one row per step
            tokens = out.sampled_token_ids[request_id] = []
            k = state.sampling_params.logprobs
            logprobs: list[TokenLogprobs] | None = None
            if wants_logprobs and k is not None:
                logprobs = out.logprobs[request_id] = []
            for row, token_id in zip(rows, emitted):
                tokens.append(token_id)
                state.num_output_tokens += 1
                if state.output_counts is not None:
                    state.output_counts[token_id] += 1
                if state.recent_output is not None:
                    state.recent_output.append(token_id)
                    del state.recent_output[:-_bad_words_memory(state.sampling_params)]
                if logprobs is not None:
                    logprobs.append(TokenLogprobs(token_id, token_lps[row], ranks[row], top_ids[row][:k],
                                                  top_lps[row][:k]))
                if state.grammar is not None:
                    self._advance_grammar(state, token_id, out)
                    if request_id in out.grammar_finished:
                        break

    @staticmethod
    def _advance_grammar(state: RequestState, token_id: int, out: ModelRunnerOutput) -> None:
        """Move the matcher past the sampled token; a finished grammar ends the request. A token it rejects can
        only come from a row it masked whole (no token allowed: the grammar cannot be completed from here), and
        fails the request rather than end it as if the text were complete."""
        if not state.grammar.accept(token_id):
            logger.warning("request %s: the grammar allows no token after the output so far; failing the request",
                           state.request_id)
            out.grammar_dead_ends.add(state.request_id)
            out.grammar_finished.add(state.request_id)
        elif state.grammar.is_terminated:
            out.grammar_finished.add(state.request_id)

    def _prompt_logprobs(self, sched: SchedulerOutput, batch: _Batch, hidden: torch.Tensor,
                         out: ModelRunnerOutput) -> None:
        """Entry j = logprob of prompt token j given tokens < j (from the row at position j-1); entry 0 is None."""
        for request_id, (first, num, start) in batch.spans.items():
            state = self.states[request_id]
            k = state.sampling_params.prompt_logprobs
            prompt_len = len(state.prompt_token_ids)
            if k is None:
                continue
            done = state.num_prompt_logprobs_done  # entries already emitted (survives preemption)
            results: list[TokenLogprobs | None] = [None] if start == 0 and done == 0 else []
            # Rows at positions p in [lo, hi) give entries p + 1.
            lo, hi = max(start, done - 1, 0), min(start + num, prompt_len - 1)
            if hi > lo:
                rows = hidden[first + lo - start:first + hi - start]
                logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
                targets = torch.tensor(state.prompt_token_ids[lo + 1:hi + 1], device=self.device)
                target_lps = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
                ranks = ((logprobs > target_lps.unsqueeze(1)).sum(-1) + 1).tolist()
                top_lps, top_ids = top_logprobs(logprobs, k)
                for t, lp, rank, ids, lps in zip(targets.tolist(), target_lps.tolist(), ranks,
                                                 top_ids.tolist(), top_lps.tolist()):
                    results.append(TokenLogprobs(t, lp, rank, ids, lps))
            if results:
                state.num_prompt_logprobs_done = done + len(results)
                out.prompt_logprobs[request_id] = results
