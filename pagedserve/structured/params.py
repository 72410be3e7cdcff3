"""StructuredOutputsParams: what a constrained request's output must match (vLLM's fields and meanings).

Exactly one of `json` (a JSON schema), `json_object` (any JSON object), `regex`, `choice` (one of these
strings) or `grammar` (EBNF/GBNF) is set. Pure Python: the checks that need the grammar library (a regex
that does not parse, a schema feature it cannot enforce) are structured/compiler.py's and schema.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedserve.config import json_object
from pagedserve.exceptions import InvalidRequestError, check_text
from pagedserve.structured.lark import lark_to_ebnf, looks_like_lark

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# Whitespace the grammar allows between JSON tokens: at most this many characters in a row, so a model
# cannot loop on spaces or newlines until max_tokens (xgrammar's max_whitespace_cnt).
MAX_JSON_WHITESPACE = 8


@dataclass(frozen=True)
class ReasoningGate:
    """A constrained request's think-block tags (token ids) and whether its prompt left a block open: its grammar
    begins after the block (SamplingParams.reasoning_gate, set by the server's --reasoning-parser; gate.py)."""

    start_id: int
    end_id: int
    opened: bool


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # vLLM's: a JSON string (or object) of xgrammar's structural tag: {"type": "structural_tag", "format": {...}}, or
    # the older {"structures": [{"begin", "schema", "end"}], "triggers": [...]} (free text until a trigger, then
    # the structure that begins there, enforced).
    structural_tag: str | dict | None = None
    # vLLM's: JSON spaced exactly as json.dumps spaces it (", " and ": ", nothing else); by default up to
    # MAX_JSON_WHITESPACE characters are allowed wherever JSON allows whitespace.
    disable_any_whitespace: bool = False
    param: str = "structured_outputs"  # the request field it came from, for error messages

    def __post_init__(self) -> None:
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidRequestError(f"{self.param}: {name} must be true or false, got {value!r}",
                                          param=self.param)
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise InvalidRequestError(f"{self.param}: give exactly one of {', '.join(KINDS)} (got {what})",
                                      param=self.param)
        for name, what in (("json", "JSON schema"), ("structural_tag", "structural tag")):  # given as JSON text
            if isinstance(getattr(self, name), str):
                try:
                    setattr(self, name, json.loads(getattr(self, name)))
                except ValueError as exc:
                    raise InvalidRequestError(f"{self.param}: the {what} is not valid JSON: {exc}",
                                              param=self.param) from None
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise InvalidRequestError(f"{self.param}: a structural tag must be a JSON object, got "
                                      f"{type(self.structural_tag).__name__}", param=self.param)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError(f"{self.param}: a JSON schema must be an object, got "
                                      f"{type(self.json).__name__}", param=self.param)
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
                raise InvalidRequestError(f"{self.param}: choice must be a non-empty list of strings",
                                          param=self.param)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{self.param}: {name} must be a non-empty string", param=self.param)
        if self.grammar is not None and looks_like_lark(self.grammar):  # vLLM takes Lark grammars too
            self.grammar = lark_to_ebnf(self.grammar, self.param)
        source = json.dumps(getattr(self, self.kind), ensure_ascii=False) if self.kind != "json_object" else ""
        check_text(source, f"{self.param}'s {self.kind}", self.param)  # the compiler's own error names its internals

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The grammar's source, canonical: two requests with the same spec share one compiled grammar."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag"):
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        if self.kind == "choice":
            return json.dumps(value)
        if self.kind == "json_object":
            return ""
        return value

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.spec, self.disable_any_whitespace

    @classmethod
    def from_request(cls, value: dict[str, Any], param: str = "structured_outputs") -> "StructuredOutputsParams":
        """From the API's `structured_outputs` object; unknown keys are a 400 (never silently ignored)."""
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{param} must be an object", param=param)
        known = set(KINDS) | {"disable_any_whitespace"}
        unknown = sorted(set(value) - known - {"backend", "whitespace_pattern", "disable_additional_properties"})
        if unknown:
            raise InvalidRequestError(f"{param}: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}",
                                      param=param)
        if value.get("backend") not in (None, "auto", "xgrammar"):
            raise InvalidRequestError(f"{param}.backend {value['backend']!r} is not available: pagedserve compiles "
                                      "grammars with xgrammar (give auto or xgrammar, or leave it out)", param=param)
        for name in ("whitespace_pattern", "disable_additional_properties"):
            if value.get(name):
                raise InvalidRequestError(f"{param}.{name} is not supported (whitespace is bounded to "
                                          f"{MAX_JSON_WHITESPACE} characters; use disable_any_whitespace for none)",
                                          param=param)
        return cls(**{k: v for k, v in value.items() if k in known}, param=param)

    @classmethod
    def from_response_format(cls, value: dict[str, Any]) -> "StructuredOutputsParams | None":
        """OpenAI's response_format: text (None), json_object, or json_schema {name, schema, strict}."""
        param = "response_format"
        if not isinstance(value, dict) or "type" not in value:
            raise InvalidRequestError("response_format needs a type: text, json_object, json_schema or "
                                      "structural_tag, e.g. {\"type\": \"json_object\"}", param=param)
        kind = value["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True, param=param)
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise InvalidRequestError("response_format json_schema needs a json_schema object with a "
                                          "schema: {\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., "
                                          "\"schema\": {...}}}", param=param)
            schema = spec["schema"]
            if not isinstance(schema, (dict, str)):  # a string: a schema written as JSON text, as vLLM takes it
                raise InvalidRequestError(f"response_format.json_schema.schema must be a JSON Schema object, got "
                                          f"{json.dumps(schema)[:40]}", param=param)
            return cls(json=schema, param=param)
        if kind == "structural_tag":  # vLLM's: the object itself is the tag
            return cls(structural_tag=value, param=param)
        raise InvalidRequestError(f"response_format type {kind!r} is not supported; use text, json_object, "
                                  "json_schema or structural_tag", param=param)


DEFAULT_COMPILE_TIMEOUT_S = 30.0
BACKENDS = ("auto", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """--structured-outputs-config (vLLM's flag, as JSON): the backend (xgrammar is ours; "auto" means it),
    a server-wide disable_any_whitespace, and compile_timeout_s: a grammar that takes longer gets a 400."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S

    @classmethod
    def parse(cls, text: str | dict | None) -> "StructuredOutputsConfig":
        """From the flag's JSON (ValueError naming the problem and the fix)."""
        if text is None:
            return cls()
        value = json_object(text, "--structured-outputs-config", '\'{"backend": "xgrammar"}\'')
        fields = {"backend", "disable_any_whitespace", "compile_timeout_s"}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"--structured-outputs-config: unknown key {unknown[0]!r}; known: "
                             f"{', '.join(sorted(fields))}")
        config = cls(**value)
        if config.backend not in BACKENDS:
            raise ValueError(f"--structured-outputs-config: backend {config.backend!r} is not available; pagedserve "
                             f"uses xgrammar (give \"xgrammar\" or \"auto\")")
        if not (isinstance(config.compile_timeout_s, (int, float)) and config.compile_timeout_s > 0):
            raise ValueError("--structured-outputs-config: compile_timeout_s must be a positive number of seconds")
        return config
