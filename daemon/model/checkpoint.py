"""Save a model as a Hugging Face-style directory, and load such a directory's weights into a model.

Loading checks names and shapes before copying anything, and every error names the tensors at fault.
Under tensor parallelism each full tensor is sliced along the axis its layer declares in `shard_axes`.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import paddle
from safetensors.numpy import save_file

from mtpserve.model import ernie_paddle
from mtpserve.model.deepseek_model import DeepseekV3ForCausalLM
from mtpserve.model.ernie_paddle import TensorSource
from mtpserve.model.ernie_model import Ernie4_5_MoeForCausalLM
from mtpserve.model.mimo_model import MiMoForCausalLM
from mtpserve.model.safetensors_reader import CheckpointError, SafetensorsFile, weight_files

log = logging.getLogger(__name__)

AnyModel = MiMoForCausalLM | DeepseekV3ForCausalLM | Ernie4_5_MoeForCausalLM
WEIGHTS_FILE = "model.safetensors"
# NOTE: Hugging Face checkpoints may carry buffers (RoPE frequencies) that this model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def save_checkpoint(model: AnyModel, directory: Path, dtype: str = "float32") -> None:
    """Write config.json and model.safetensors (full tensors; call with tp_size == 1)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    np_dtype = {"float32": np.float32, "float16": np.float16}[dtype]
    tensors = {name: np.ascontiguousarray(p.numpy().astype(np_dtype))
               for name, p in model.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")


def load_weights(model: AnyModel, directory: Path) -> None:
    """Copy a checkpoint's tensors into `model`, sliced for its tensor-parallel rank."""
    sources: dict[str, TensorSource] = dict(_index_tensors(weight_files(directory)))
    if isinstance(model, Ernie4_5_MoeForCausalLM) and ernie_paddle.is_paddle_release(set(sources)):
        sources = ernie_paddle.as_hf_layout(sources, model.config)
    targets = model.state_dict()
    axes = _shard_axes(model)
    _check_names(set(targets), set(sources), model.config.tie_word_embeddings)
    _check_shapes(targets, sources, axes, model.tp.size)
    for name in _progress(sorted(targets), directory):
        full = sources[name].read(name)
        local = _shard(full, axes.get(name), model.tp.rank, model.tp.size)
        targets[name].set_value(paddle.to_tensor(local.astype(np.float32)).astype(targets[name].dtype))


def _index_tensors(files: list[Path]) -> dict[str, SafetensorsFile]:
    found: dict[str, SafetensorsFile] = {}
    for path in files:
        if not path.exists():
            raise CheckpointError(f"weight file listed by the index is missing: {path}")
        reader = SafetensorsFile(path)
        for name in reader.names():
            found[name] = reader
    return found


def _check_names(expected: set[str], present: set[str], tied: bool) -> None:
    present = {n for n in present if not n.endswith(IGNORED_SUFFIXES)}
    if tied:
        present.discard("lm_head.weight")  # some tied checkpoints store the head anyway
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:10])}")
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensor(s): "
                              f"{', '.join(unexpected[:10])}")


def _check_shapes(targets: dict, sources: dict[str, TensorSource], axes: dict, tp_size: int) -> None:
    for name, param in targets.items():
        want = list(param.shape)
        if axes.get(name) is not None:
            want[axes[name]] *= tp_size
        got = list(sources[name].shape(name))
        if got != want:
            raise CheckpointError(f"tensor {name} has shape {got} in the checkpoint, the model expects {want}")


def _shard_axes(model: AnyModel) -> dict[str, int | None]:
    axes: dict[str, int | None] = {}
    for prefix, layer in model.named_sublayers():
        for pname, axis in getattr(layer, "shard_axes", {}).items():
            axes[f"{prefix}.{pname}"] = axis
    return axes


def _shard(full: np.ndarray, axis: int | None, rank: int, size: int) -> np.ndarray:
    if axis is None or size == 1:
        return full
    local = full.shape[axis] // size
    return np.take(full, np.arange(rank * local, (rank + 1) * local), axis=axis)


def _progress(names: list[str], directory: Path):
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(names, desc=f"loading {Path(directory).name}", unit="tensor")
    log.info("loading %d tensors from %s", len(names), directory)
    return names
