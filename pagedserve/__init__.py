"""pagedserve: a vLLM-class LLM inference server for CPU boxes and GPUs."""

from pagedserve.inputs import TextPrompt, TokensPrompt
from pagedserve.outputs import (CompletionOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput)
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EmbeddingRequestOutput", "EngineArgs", "LLMEngine", "PoolingParams",
           "PoolingRequestOutput", "PromptType", "RequestOutput", "SamplingParams", "ScoringRequestOutput",
           "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name: str):
    # These pull in torch; import them only when asked for, so `import pagedserve` stays light.
    if name == "LLM":
        from pagedserve.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedserve.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "ScoringRequestOutput":
        from pagedserve.scoring import ScoringRequestOutput

        return ScoringRequestOutput
    if name == "PromptType":
        from pagedserve.engine.llm_engine import PromptType

        return PromptType
    if name == "EngineArgs":
        from pagedserve.engine.arg_utils import EngineArgs

        return EngineArgs
    raise AttributeError(name)
