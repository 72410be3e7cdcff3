"""Structured outputs: constrained decoding on xgrammar (JSON schema, json_object, regex, choice, EBNF).

params.py (what a request asks for, pure Python) -> schema.py (which JSON-schema features are enforced) ->
compiler.py (compile off the engine thread, cached) -> admission.py (requests wait for their grammar without
KV blocks) -> matcher.py (per-request matcher; one bitmask call per step in the sampler).
"""

from pagedserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
