"""A safetensors checkpoint directory, read one memory-mapped tensor at a time.

``model.safetensors``, or ``model.safetensors.index.json`` with its shards. FP8 (e4m3) weights
with 128x128 block scales (``<name>_scale_inv`` beside ``<name>``, the published MiMo-V2-Flash
format) are dequantized as they are read: ``weight[i, j] * scale_inv[i // 128, j // 128]``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from hal.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
FP8_BLOCK = 128
FP8_DTYPES = (torch.float8_e4m3fn,)


class Checkpoint:
    """Names, shapes and lazily read tensors of one checkpoint directory."""

    def __init__(self, directory: Path | str) -> None:
        try:
            from safetensors import SafetensorError, safe_open
        except ImportError as exc:  # an optional dependency of checkpoint loading only
            raise CheckpointError("reading checkpoints needs safetensors (a dependency of hal): pip install safetensors") from exc
        self._safe_open = safe_open
        self._read_errors = (SafetensorError, OSError)
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"missing checkpoint directory: {self.directory}")
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index (no weight_map)") from exc
            self._file_of = {name: self.directory / file for name, file in weight_map.items()}
        elif (self.directory / SINGLE_FILE).is_file():
            single = self.directory / SINGLE_FILE
            try:
                with safe_open(str(single), framework="pt") as f:
                    self._file_of = {name: single for name in f.keys()}
            except self._read_errors as exc:  # truncated, empty, not safetensors
                raise CheckpointError(f"{single}: not a readable safetensors file ({exc})") from exc
        else:
            raise CheckpointError(f"missing file: {self.directory / SINGLE_FILE} (or {INDEX_FILE} with its shards)")
        for file in sorted(set(self._file_of.values())):
            if not file.is_file():
                raise CheckpointError(f"missing file: {file} (listed in {INDEX_FILE})")
        self._handles: dict[Path, Any] = {}

    @property
    def names(self) -> set[str]:
        """Tensor names, block scales of FP8 weights excluded (they are read with their weight)."""
        return {n for n in self._file_of if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self._file_of)}

    def _handle(self, name: str) -> Any:
        file = self._file_of.get(name)
        if file is None:
            raise CheckpointError(f"missing tensor {name!r} in {self.directory}")
        if file not in self._handles:
            self._handles[file] = self._safe_open(str(file), framework="pt")
        return self._handles[file]

    def _read(self, name: str, what: str) -> Any:
        """``get_slice`` (``what="slice"``) or ``get_tensor`` of ``name`` from the file the index names;
        a file that cannot be opened or lacks the tensor is a ``CheckpointError`` naming both."""
        try:
            handle = self._handle(name)
            return handle.get_slice(name) if what == "slice" else handle.get_tensor(name)
        except self._read_errors as exc:
            raise CheckpointError(f"tensor {name!r}: cannot be read from {self._file_of[name]} ({exc})") from exc

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name`` (reads no data)."""
        return tuple(self._read(name, "slice").get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        """``name``, memory-mapped; FP8 weights come back dequantized to float32. Weights are
        floating point (an integer or bool tensor is a ``CheckpointError``, never cast) and finite
        (a NaN or inf is a ``CheckpointError`` naming the tensor: it would decode garbage)."""
        raw = self._read(name, "tensor")
        scale_name = name + SCALE_SUFFIX
        if raw.dtype in FP8_DTYPES:
            if scale_name not in self._file_of:
                raise CheckpointError(f"tensor {name!r} is {raw.dtype} but {scale_name!r} (its block scales) is missing")
            raw = dequantize_fp8(raw, self._read(scale_name, "tensor"), name)
        if not raw.is_floating_point():
            raise CheckpointError(f"tensor {name!r} is stored as {raw.dtype}; weights are floating point "
                                  "(float32, bfloat16, float16, or FP8 with block scales)")
        if not bool(torch.isfinite(raw).all()):
            bad = int((~torch.isfinite(raw)).sum())
            raise CheckpointError(f"tensor {name!r} holds {bad} NaN or inf values of {raw.numel()}")
        return raw

    def layer_indices(self, prefix: str) -> list[int]:
        """Sorted ``k`` of every ``{prefix}{k}.`` tensor name (e.g. ``model.mtp.layers.``)."""
        pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
        return sorted({int(m.group(1)) for n in self._file_of if (m := pattern.match(n))})

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """``weight[i, j] * scale_inv[i // 128, j // 128]`` in float32 (a ragged last block included)."""
    if weight.dim() != 2:
        raise CheckpointError(f"FP8 tensor {name!r} must be 2-D for 128x128 block scales, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    expect = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if tuple(scale_inv.shape) != expect:
        raise CheckpointError(
            f"tensor {name + SCALE_SUFFIX!r}: shape mismatch, expected {expect} for a {tuple(weight.shape)} weight, found {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return weight.float() * scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The published format's FP8 e4m3 weight and 128x128 ``scale_inv`` for a 2-D float weight."""
    rows, cols = weight.shape
    blocks = torch.nn.functional.pad(weight.float(), (0, -cols % FP8_BLOCK, 0, -rows % FP8_BLOCK))
    tiles = blocks.view(blocks.shape[0] // FP8_BLOCK, FP8_BLOCK, blocks.shape[1] // FP8_BLOCK, FP8_BLOCK)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    scale = scale_inv.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return (weight.float() / scale).to(torch.float8_e4m3fn), scale_inv


def save_checkpoint(directory: Path | str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to ``directory`` (created if needed)."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:  # an optional dependency of checkpoints only
        raise CheckpointError("writing checkpoints needs safetensors (a dependency of hal): pip install safetensors") from exc

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / SINGLE_FILE), metadata={"format": "pt"})
    # safetensors writes through a private temporary file (mode 0600): give it config.json's mode
    (directory / SINGLE_FILE).chmod((directory / "config.json").stat().st_mode & 0o777)
    return directory
