"""Build a model from a Hugging Face directory or a GGUF file, without random initialisation."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from pagedserve.formats.errors import ModelValidationError
from pagedserve.formats.multimodal import language_model_name
from pagedserve.formats.safetensors import read_safetensors_header, safetensors_files
from pagedserve.kernels import CpuKernels
from pagedserve.layers.backend import KernelBackend
from pagedserve.layers.linear import BlockWeight, QuantizedWeight
from pagedserve.layers.skip_init import skip_init
from pagedserve.memory.weight_format import FILE_QUANTIZATION
from pagedserve.models.registry import model_class
from pagedserve.models.safetensors_mmap import iter_safetensors
from pagedserve.platform import release_free_heap
from pagedserve.formats import is_gguf_path

logger = logging.getLogger(__name__)

# progress(fraction_done, phase) is called while weights load ("loading_weights") and are packed for the kernels
# ("preparing_weights"), for /health and the start-up log; a draft model's weights go through both phases again.
ProgressFn = Callable[..., None]


def load_hf_config(model_path: str) -> Any:
    """transformers config for a model directory or a GGUF file."""
    from transformers import AutoConfig

    if is_gguf_path(model_path):
        from pagedserve.models.gguf_loader import GGUFCheckpoint

        config_dict = GGUFCheckpoint(model_path).hf_config()
        model_type = config_dict.pop("model_type")
        return AutoConfig.for_model(model_type, **config_dict)
    return AutoConfig.from_pretrained(model_path)


class CheckpointTensors(NamedTuple):
    num_tensors: int  # for progress
    tensors: Iterator[tuple[str, torch.Tensor | QuantizedWeight]]  # (checkpoint name, tensor)
    views_file: bool  # whether the tensors are views of the memory-mapped file (safetensors), not copies (GGUF)


def iter_checkpoint(model_path: str, dtype: torch.dtype, int8: bool = False, kernels: CpuKernels | None = None,
                    blocks: bool = False) -> CheckpointTensors:
    """The tensors of a directory or a GGUF file. With `int8`, a GGUF's block-quantized matmul weights come
    as QuantizedWeight (no bf16 copy on the way), requantized by `kernels` (the model's native kernels) where
    given; with `blocks` too, those the native block kernel takes come as BlockWeight (their own bits). Every GGUF
    tensor is decoded into memory of its own."""
    if is_gguf_path(model_path):
        from pagedserve.models.gguf_loader import GGUFCheckpoint

        checkpoint = GGUFCheckpoint(model_path)
        tensors = checkpoint.iter_tensors(dtype, int8_matmuls=int8, kernels=kernels, block_matmuls=blocks)
        return CheckpointTensors(checkpoint.num_tensors, tensors, False)
    files = safetensors_files(Path(model_path))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")

    def generate() -> Iterator[tuple[str, torch.Tensor]]:
        for path in files:
            yield from iter_safetensors(path)

    return CheckpointTensors(sum(len(read_safetensors_header(p).tensors) for p in files), generate(), True)


def load_model(hf_config: Any, architecture: str, model_path: str, dtype: torch.dtype, device: str,
               max_position: int, progress: ProgressFn | None = None, quantization: str | None = None,
               reference_kernels: bool = False, task: str = "generate", tp: Any = None) -> nn.Module:
    """Instantiate on the meta device, then bind checkpoint tensors to parameters by name. `tp`: a
    distributed TPGroup; the model then holds this rank's shard, sliced from each tensor as it is read."""
    cls = model_class(architecture, task)
    with torch.device("meta"), skip_init():
        model = cls(hf_config, max_position) if tp is None else cls(hf_config, max_position, tp=tp)
    if tp is None:  # every name and shape first, from the headers: a mismatch is refused before any data is read
        _check_shapes(model, architecture, model_path)
    shapes = _ShapeCheck(model, architecture, model_path)
    backend = KernelBackend.choose(device, dtype, quantization, reference_kernels)  # the one decision
    # a GGUF's own blocks (--quantization gguf; setup gives tensor-parallel ranks int8 rows: blocks are not split)
    checkpoint = iter_checkpoint(model_path, dtype, int8=backend.linear_kind == "int8", kernels=backend.native,
                                 blocks=quantization == FILE_QUANTIZATION and tp is None)
    num_tensors = checkpoint.num_tensors
    if progress:  # the phase named: a draft model loads after its target's preparing_weights
        progress(0.0, "loading_weights")
    for index, (name, tensor) in enumerate(_parts(model, checkpoint.tensors)):
        target = shapes.target(name)
        if target is None:
            continue
        if tp is not None:  # a view of the mapped file where it can: only this rank's pages are read
            tensor = model.shard_checkpoint_tensor(target, tensor)
            if not checkpoint.views_file and isinstance(tensor, torch.Tensor) and tensor._base is not None:
                tensor = tensor.clone()  # a GGUF tensor is decoded whole: a view of its rows kept all of it alive
        shapes.verify(name, target, tuple(tensor.shape))
        if isinstance(tensor, QuantizedWeight):  # kept aside for prepare(): the parameter stays unbound
            module_name, _, _ = target.rpartition(".")
            model.get_submodule(module_name).quantized_weight = QuantizedWeight(
                tensor.qweight.to(device), tensor.scales.to(device), dtype)
        elif isinstance(tensor, BlockWeight):  # as above (a CPU's native kernels made it)
            model.get_submodule(target.rpartition(".")[0]).quantized_weight = tensor
        else:
            _set_parameter(model, target, tensor.to(device=device, dtype=dtype))
        if progress and num_tensors:
            progress(min(1.0, (index + 1) / num_tensors), "loading_weights")
    shapes.finish()
    _move_buffers(model, device)
    reporting, done = _reporting(backend, model, progress)
    model.prepare(reporting)
    done()
    model.kernel_backend = backend  # what else runs on this model's outputs (the sampler's argmax) reads it
    logger.info("kernels: %s", backend.describe())
    for line in model.kernel_report() if hasattr(model, "kernel_report") else ():
        logger.info("kernels: %s", line)
    if backend.linear_kind != "plain" and checkpoint.views_file:
        _release_checkpoint_mapping(model)
    release_free_heap()
    return model.eval()


def _reporting(backend: KernelBackend, model: nn.Module, progress: ProgressFn | None
               ) -> tuple[KernelBackend, Callable[[], None]]:
    """(`backend` reporting the preparing_weights phase's progress as linears are made from it, a call that ends the
    phase's reports). Progress is the share of the model's matrices (by elements) made so far. Packing reads the
    weights for the first time where they are views of the mapped file: on a cold page cache most of a start's
    reading happens there (15 s of a 1B model's, seen silent after "loading_weights 100%")."""
    if progress is None:
        return backend, lambda: None
    # the matrices linears are made of: an embedding table only where it is also the logits projection (tied)
    tied = bool(getattr(model, "tie_word_embeddings", False))
    tables = set() if tied else {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    total = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in tables) or 1
    made, reporting = 0, True
    progress(0.0, "preparing_weights")

    def on_weight(elements: int) -> None:
        nonlocal made
        made += elements
        if reporting:  # a layer that keeps the backend and makes a linear later is not start-up
            progress(min(1.0, made / total), "preparing_weights")

    def done() -> None:
        nonlocal reporting
        progress(1.0, "preparing_weights")
        reporting = False

    return dataclasses.replace(backend, on_weight=on_weight), done


class _ShapeCheck:
    """The checkpoint's tensors against the model's parameters, by name and shape: one home for the checks (and
    their messages) that loading and `doctor` make."""

    def __init__(self, model: nn.Module, architecture: str, model_path: str) -> None:
        self.model = model
        self.architecture = architecture
        self.params = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.missing = set(self.params)
        self.fix = ("the GGUF file's metadata does not match its tensors (a broken conversion: convert the model "
                    "again)" if is_gguf_path(model_path) else
                    "config.json does not match the weights (download the model again)")

    def target(self, name: str) -> str | None:
        """The parameter a checkpoint tensor binds to (None: a tensor the model does not use, such as a multimodal
        checkpoint's vision tower)."""
        text_name = language_model_name(name)
        target = None if text_name is None else self.model.checkpoint_name_to_param(text_name)
        if target is not None and target not in self.params:
            raise ModelValidationError(f"checkpoint tensor {name!r} has no matching parameter in {self.architecture}: "
                                       f"{self.fix}")
        return target

    def verify(self, name: str, target: str, shape: tuple[int, ...]) -> None:
        expected = self.params[target]
        if tuple(shape) != expected:
            raise ModelValidationError(f"checkpoint tensor {name!r} has shape {tuple(shape)}, the model expects "
                                       f"{expected}: {self.fix}")
        self.missing.discard(target)

    def finish(self) -> None:
        if self.missing:
            raise ModelValidationError(f"the checkpoint lacks {len(self.missing)} tensors the model needs, e.g. "
                                       f"{sorted(self.missing)[:3]}: {self.fix}")


def _parts(model: nn.Module, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Each checkpoint tensor as the parts the model binds (model.checkpoint_parts): views of its rows where a
    checkpoint fuses several matrices into one (a quantized one's int8 rows with their scales: one per row), the
    tensor itself elsewhere."""
    for name, tensor in tensors:
        parts = _checkpoint_parts(model, name, tuple(tensor.shape))
        if len(parts) == 1:
            yield name, tensor
            continue
        for part, start, rows in parts:
            if isinstance(tensor, BlockWeight):
                yield part, tensor.narrow(start, rows)
            elif isinstance(tensor, QuantizedWeight):
                yield part, QuantizedWeight(tensor.qweight.narrow(0, start, rows), tensor.scales.narrow(0, start, rows),
                                            tensor.dtype)
            else:
                yield part, tensor.narrow(0, start, rows)


def _checkpoint_parts(model: nn.Module, name: str, shape: tuple[int, ...]) -> list[tuple[str, int, int]]:
    rows = shape[0] if shape else 0
    split = getattr(model, "checkpoint_parts", None)  # decoders; an encoder's tensors are each one parameter
    return [(name, 0, rows)] if split is None else split(name, rows)


def _shape_parts(model: nn.Module, name: str, shape: tuple[int, ...], fix: str
                 ) -> Iterator[tuple[str, tuple[int, ...]]]:
    """What _parts does to a tensor, on its header's shape."""
    parts = _checkpoint_parts(model, name, shape)
    if len(parts) > 1 and sum(rows for _, _, rows in parts) != shape[0]:
        raise ModelValidationError(f"checkpoint tensor {name!r} has {shape[0]} rows, the model expects "
                                   f"{' + '.join(str(rows) for _, _, rows in parts)}: {fix}")
    for part, _, rows in parts:
        yield part, (rows, *shape[1:]) if len(parts) > 1 else shape


def checkpoint_shapes(model_path: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor's (name, shape), from the file headers (a GGUF's under their Hugging Face names)."""
    if is_gguf_path(model_path):
        from pagedserve.formats.gguf_hf import GGUFFile

        for spec in GGUFFile(model_path).tensor_specs():
            yield spec.name, tuple(spec.shape)
        return
    for path in safetensors_files(Path(model_path)):
        for name, entry in read_safetensors_header(path).tensors.items():
            yield name, tuple(entry["shape"])


def _check_shapes(model: nn.Module, architecture: str, model_path: str) -> None:
    shapes = _ShapeCheck(model, architecture, model_path)
    for fused_name, fused_shape in checkpoint_shapes(model_path):
        for name, shape in _shape_parts(model, fused_name, fused_shape, shapes.fix):
            target = shapes.target(name)
            if target is not None:
                shapes.verify(name, target, shape)
    shapes.finish()


def check_checkpoint_shapes(hf_config: Any, architecture: str, model_path: str, max_position: int,
                            task: str = "generate") -> None:
    """What loading checks of the tensors' names and shapes, from the headers alone (`pagedserve doctor`):
    ModelValidationError naming the first tensor that does not fit the model config.json (or a GGUF's
    metadata) describes."""
    with torch.device("meta"), skip_init():
        model = model_class(architecture, task)(hf_config, max_position)
    _check_shapes(model, architecture, model_path)


def _release_checkpoint_mapping(model: nn.Module) -> None:
    """Once every matmul weight has been re-laid out (packed or quantized), the tensors still viewing the
    memory-mapped checkpoint are small (norms, biases, the embedding table): copy them, so the mapping
    closes and the checkpoint pages it made resident stop counting against this process (~0.7 GB for a
    0.5B bf16 model). Plain kernels use the mapped weights as they are, so they keep the mapping."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=False)


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


def _move_buffers(model: nn.Module, device: str) -> None:
    """Buffers (rotary tables) are built on the CPU; move them next to the weights."""
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type != device:
                module._buffers[name] = buffer.to(device)
