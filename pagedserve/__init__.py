"""pagedserve: a vLLM-class LLM inference server for CPU boxes and GPUs."""

from pagedserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked for, so `import pagedserve` stays light.
    if name == "LLM":
        from pagedserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
