"""Grammar compilation on xgrammar, off the engine thread, cached by (grammar, tokenizer).

One GrammarCompiler per engine (one tokenizer). `submit` checks what it can at once (a schema feature the
grammar cannot enforce, an invalid schema: InvalidRequestError) and returns a Future of the compiled grammar;
compiling runs on worker threads (structured/workers.py: a grammar past the compile time limit is given up and
holds no one else up), so the engine keeps stepping other requests meanwhile. Futures are
cached by the grammar's canonical spec, so a repeated schema costs nothing after its first use; the cache is
bounded by count and by the compiled grammars' bytes (a JSON schema over a 152k vocabulary is ~1.8 MiB; a client
sending 100,000-value choices grew the server by 230 MB a request, QA-U). xgrammar (its
import, its scan of the vocabulary and the UTF-8 guard's table: ~1.6 s for a 152k vocabulary on 2 AVX2 cores)
is loaded on the worker at the first constrained request: servers that never see one never pay for it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from pagedserve.exceptions import InvalidRequestError
from pagedserve.structured.admission import compile_timeout_error
from pagedserve.structured.matcher import CompiledGrammar
from pagedserve.structured.params import MAX_JSON_WHITESPACE, StructuredOutputsParams
from pagedserve.structured.schema import check_json_schema
from pagedserve.memory.sizes import GRAMMAR_CACHE_BYTES
from pagedserve.structured.workers import CompileWorkers

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
LATE_TIMES_REFUSED = 2  # compiles past the time limit, each larger than the cache, after which a grammar is refused
NUM_COMPILE_WORKERS = 2
# xgrammar's errors start with "[hh:mm:ss] /project/cpp/file.cc:123: ": not the client's business.
_LOCATION_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, on_compiled: Callable[[float], None] | None = None,
                 disable_any_whitespace: bool = False, compile_timeout_s: float | None = None) -> None:
        self.tokenizer = tokenizer
        self.disable_any_whitespace = disable_any_whitespace  # server-wide (--structured-outputs-config)
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's vocabulary)
        self.on_compiled = on_compiled  # seconds per compilation (metrics)
        self.compile_timeout_s = compile_timeout_s
        self._executor = CompileWorkers(NUM_COMPILE_WORKERS, compile_timeout_s)
        self._cache: OrderedDict[tuple, Future] = OrderedDict()  # least recently used first
        self._sizes: dict[tuple, int] = {}  # the compiled grammar's bytes, per cached key that has one
        # Grammars that compiled only after the time limit and larger than the cache, each time: key -> (bytes,
        # times). Twice, and it is never ready in time (each retry compiled again for minutes, holding a worker,
        # and got the same 400, QA-F); once may have been a busy moment of the box.
        self._never_in_time: OrderedDict[tuple, tuple[int, int]] = OrderedDict()
        self.cached_bytes = 0
        self._lock = threading.RLock()  # a Future done at once runs its callback (_account) under submit's lock
        self._load_lock = threading.Lock()
        self._xgr_info: Any = None  # xgrammar's TokenizerInfo: the vocabulary scanned once
        self._local = threading.local()  # a worker's own xgrammar GrammarCompiler
        self._utf8: Any = None  # structured.utf8.Utf8Guard for this tokenizer, built with the compiler
        self._special_ids: frozenset[int] = frozenset()  # ids no grammar accepts (xgrammar's special tokens)
        self._freed_bytes = 0  # compiled grammars' bytes freed since the last take_freed_bytes()
        self._freed_lock = threading.Lock()  # a grammar is freed on whichever thread drops it last

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A Future of the compiled grammar (done at once when cached). Raises InvalidRequestError for a
        schema that is invalid or uses a feature nothing enforces; the Future raises it for anything the
        compiler itself rejects (a regex or grammar that does not parse)."""
        if self.disable_any_whitespace and not params.disable_any_whitespace:
            params = replace(params, disable_any_whitespace=True)
        with self._lock:
            future = self._cache.get(params.key)
            if future is not None:
                self._cache.move_to_end(params.key)
                return future
            size, times = self._never_in_time.get(params.key, (0, 0))
        if times >= LATE_TIMES_REFUSED:
            raise InvalidRequestError(
                f"{params.param}: this grammar compiles for longer than compile_timeout_s "
                f"({self.compile_timeout_s:g} s) and to {size / 2 ** 20:.0f} MiB, more than the "
                f"{GRAMMAR_CACHE_BYTES / 2 ** 20:.0f} MiB kept for compiled grammars, so it is never ready in time: "
                "simplify the schema (e.g. a shorter enum), or raise compile_timeout_s (--structured-outputs-config)",
                param=params.param)
        if params.kind == "json":
            check_json_schema(params.json, params.param)  # only schemas that pass are cached
        with self._lock:
            future = self._cache.get(params.key)
            if future is not None:
                return future
            late = None
            if self.compile_timeout_s is not None:
                timeout = self.compile_timeout_s
                late = lambda: compile_timeout_error(timeout, params)  # noqa: E731
            future = self._executor.submit(self._compile, params, late_error=late,
                                           late_result=lambda grammar: self._cache_late(params.key, future, grammar))
            self._cache[params.key] = future
            future.add_done_callback(lambda done: self._account(params.key, done))
            self._evict()
            return future

    def _cache_late(self, key: tuple, given_up: Future, grammar: CompiledGrammar) -> None:
        """A grammar given up on at the time limit compiled after all: later requests use it (the time limit
        guards requests from waiting, and the wait was over; a busy box made it slow, not the grammar)."""
        done: Future = Future()
        done.set_result(grammar)
        size = grammar.num_bytes
        with self._lock:
            if size > GRAMMAR_CACHE_BYTES:  # _account would not keep it: asked again, it would be late again
                if self._cache.get(key) is given_up:
                    del self._cache[key]
                self._never_in_time[key] = (size, self._never_in_time.get(key, (0, 0))[1] + 1)
                while len(self._never_in_time) > MAX_CACHED_GRAMMARS:
                    self._never_in_time.popitem(last=False)
                return
            if self._cache.get(key) is given_up:
                self._cache[key] = done
                self._account(key, done)

    def _account(self, key: tuple, future: Future) -> None:
        """Count a compiled grammar's bytes while it is cached, and evict down to the bounds."""
        if future.cancelled() or future.exception() is not None:
            return
        size = future.result().num_bytes
        with self._lock:
            if self._cache.get(key) is not future:
                return  # evicted meanwhile: nothing of it is kept
            if size > GRAMMAR_CACHE_BYTES:  # larger than the whole budget: not kept, and the others stay
                del self._cache[key]
                self.cached_bytes -= self._sizes.pop(key, 0)
                return
            self.cached_bytes += size - self._sizes.get(key, 0)
            self._sizes[key] = size
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used grammars while more than MAX_CACHED_GRAMMARS or GRAMMAR_CACHE_BYTES are
        kept (_account keeps none larger than the whole budget: compiled again when asked again). Requests hold
        their own reference: a grammar in use stays alive until they end."""
        with self._lock:
            while self._cache and (len(self._cache) > MAX_CACHED_GRAMMARS or self.cached_bytes > GRAMMAR_CACHE_BYTES):
                key, _ = self._cache.popitem(last=False)
                self.cached_bytes -= self._sizes.pop(key, 0)

    def take_freed_bytes(self) -> int:
        """The bytes of compiled grammars freed since the last call (by their request's end and the cache): the
        engine trims the heap after a large amount, freed from the compile threads' arenas (QA-G)."""
        with self._freed_lock:
            freed, self._freed_bytes = self._freed_bytes, 0
        return freed

    def _count_freed(self, num_bytes: int) -> None:
        with self._freed_lock:
            self._freed_bytes += num_bytes

    def compile(self, params: StructuredOutputsParams, timeout: float | None = None) -> Any:
        """Blocking: the compiled grammar (InvalidRequestError as submit/the Future would raise)."""
        return self.submit(params).result(timeout)

    # ---- on the worker thread -------------------------------------------------------------------
    def _compiler(self) -> Any:
        """This worker's xgrammar compiler, over the tokenizer's scanned vocabulary (scanned once)."""
        compiler = getattr(self._local, "compiler", None)
        if compiler is not None:
            return compiler
        import xgrammar as xgr

        with self._load_lock:
            if self._xgr_info is None:
                start = time.perf_counter()
                from pagedserve.structured.utf8 import Utf8Guard
                from pagedserve.tokenizer import as_transformers

                info = xgr.TokenizerInfo.from_huggingface(as_transformers(self.tokenizer), vocab_size=self.vocab_size)
                self._utf8 = Utf8Guard(info.decoded_vocab, self.vocab_size)
                self._special_ids = frozenset(info.special_token_ids)
                self._xgr_info = info
                logger.info("structured outputs: xgrammar loaded and this tokenizer's vocabulary scanned in %.2f s",
                            time.perf_counter() - start)
        # No cache of xgrammar's own: ours (self._cache) is shared by the workers and bounded.
        self._local.compiler = xgr.GrammarCompiler(self._xgr_info, max_threads=1, cache_enabled=False)
        return self._local.compiler

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        compiler = self._compiler()
        start = time.perf_counter()
        try:
            compiled = _compile_kind(compiler, params)
        except Exception as exc:  # noqa: BLE001 - the client's grammar: whatever xgrammar raises is a 400
            logger.info("grammar rejected: %s: %s", type(exc).__name__, exc)
            message = _LOCATION_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
            raise InvalidRequestError(f"{params.param}: the {_KIND_NAMES[params.kind]} cannot be compiled: "
                                      f"{message}", param=params.param) from None
        seconds = time.perf_counter() - start
        if self.on_compiled is not None:
            self.on_compiled(seconds)
        logger.debug("compiled a %s grammar in %.3f s", params.kind, seconds)
        grammar = CompiledGrammar(compiled, self._utf8, self._special_ids)
        weakref.finalize(grammar, self._count_freed, grammar.num_bytes)
        return grammar


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice",
               "grammar": "grammar", "structural_tag": "structural tag"}


def _compile_kind(compiler: Any, params: StructuredOutputsParams) -> Any:
    whitespace = {"any_whitespace": not params.disable_any_whitespace, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    if params.disable_any_whitespace:
        whitespace = {"any_whitespace": False}
    if params.kind == "json":
        return compiler.compile_grammar(json_schema_grammar(params.json, **whitespace))
    if params.kind == "json_object":
        return compiler.compile_json_schema(json.dumps({"type": "object"}), strict_mode=False, **whitespace)
    if params.kind == "regex":
        return compiler.compile_regex(params.regex)
    if params.kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_string(c) for c in params.choice))
    if params.kind == "structural_tag":
        return _compile_structural_tag(compiler, params.structural_tag)
    return compiler.compile_grammar(params.grammar)


def _compile_structural_tag(compiler: Any, tag: dict) -> Any:
    """xgrammar's structural tag; the older form with "structures" and "triggers" as vLLM reads it (each
    structure's schema a JSON schema object or string)."""
    if "structures" not in tag:
        return compiler.compile_structural_tag(json.dumps(tag))
    import xgrammar

    try:
        items = [xgrammar.StructuralTagItem(begin=s["begin"], end=s["end"], schema=s["schema"] if isinstance(
            s["schema"], str) else json.dumps(s["schema"])) for s in tag["structures"]]
        triggers = list(tag["triggers"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"a structural tag's structures each need begin, schema and end, and it needs triggers "
                         f"({type(exc).__name__}: {exc})") from None
    return compiler.compile_structural_tag(items, triggers)


# xgrammar writes a minLength/maxLength string as `"\"" rule_characters{lo, hi} "\""` with this class, which
# admits raw control characters: not JSON. Replaced by STRING_CHARACTER, any character but those, '"' and '\\'
# (such strings cannot hold '"' or '\\'). Classes of positive ranges would also refuse ill-formed UTF-8, but take
# seconds to compile or ~100 ms per bitmask; structured/utf8.py's guard does that for every constrained row.
XGRAMMAR_BOUNDED_CHARACTER = '[^\\"\\\\\\r\\n]'
STRING_CHARACTER = '[^\\0-\\x1f\\"\\\\]'


def json_schema_grammar(schema: Any, **options: Any) -> Any:
    """The xgrammar Grammar of a JSON schema (strict: objects take only listed properties), with length-bounded
    strings made JSON (see XGRAMMAR_BOUNDED_CHARACTER)."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True, **options)
    ebnf = str(grammar)
    if XGRAMMAR_BOUNDED_CHARACTER not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(XGRAMMAR_BOUNDED_CHARACTER, STRING_CHARACTER))


def _ebnf_string(text: str) -> str:
    """A GBNF string literal for `text` (JSON escapes are GBNF's)."""
    return json.dumps(text, ensure_ascii=False)
