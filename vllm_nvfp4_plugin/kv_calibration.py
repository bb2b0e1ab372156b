"""Per-layer KV-cache policy of an NVFP4 cache: the file `python -m vllm_nvfp4_plugin.tools.calibrate` writes and
the engine loads (vLLM-free; the adapters apply it).

The key format is the model's: "nvfp4" (the NVFP4 page), "fp8" (FP8 E4M3 keys, NVFP4 values: a page 25/18 the size)
or "int8" (INT8 keys with one fp16 scale per token and head, NVFP4 values). vLLM sizes every layer's page from one backend-wide spec hook that does not see the layer, so a model's layers
share one key format. Every layer then picks:
- its store rule: "nvfp4" (block scale max/6) or "nvfp4_4over6" (max/6 or max/4, whichever errs less);
- optionally per-channel key smoothing: keys are stored as k / s and queries multiplied by s before attention,
  so q·k is unchanged in exact arithmetic. s is a power of two per (KV head, channel), so k / s and q · s are exact
  in bf16/fp16 too: smoothing only changes what the 4-bit format has to represent. s is equal on the two channels
  of each RoPE pair (i, i + head/2): a pair's magnitude moves between its channels with the position, so only
  their common envelope is a property of the channel pair.

File (JSON): {"format": FORMAT, "model": str, "num_layers": L, "num_kv_heads": H, "head_size": D,
"key_format": "nvfp4" | "fp8" | "int8" (optional, default "nvfp4"), "layers": [{"layer": i, "mode": "nvfp4" | "nvfp4_4over6", "key_scales": [[D floats] * H] | null}, ...]} with
exactly one entry per layer 0..L-1; other keys (the calibration's statistics) are kept but not read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "vllm_nvfp4_plugin.kv_calibration/1"
LAYER_MODES = ("nvfp4", "nvfp4_4over6")
KEY_FORMATS = ("nvfp4", "fp8", "int8")


class CalibrationError(ValueError):
    """A calibration file that does not fit the model, or is malformed; the message names the file and the rule."""


@dataclass(frozen=True)
class LayerPolicy:
    mode: str
    key_scales: torch.Tensor | None  # float32 [num_kv_heads, head_size], powers of two; None: no smoothing


@dataclass(frozen=True)
class KVCalibration:
    model: str
    num_kv_heads: int
    head_size: int
    layers: tuple[LayerPolicy, ...]
    key_format: str = "nvfp4"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def check_model(self, num_layers: int, num_kv_heads: int, head_size: int, source: str) -> None:
        """Raise naming `source` when this calibration was made for another shape of model."""
        for name, have, want in (("num_layers", self.num_layers, num_layers),
                                 ("num_kv_heads", self.num_kv_heads, num_kv_heads),
                                 ("head_size", self.head_size, head_size)):
            if have != want:
                raise CalibrationError(f"{source}: {name} is {have}, but the model has {want} "
                                       f"(calibrated for {self.model!r}; rerun the calibration for this model)")


def rope_pair_power_of_two_scales(channel_amax: torch.Tensor, reference: torch.Tensor,
                                  alpha: float = 1.0) -> torch.Tensor:
    """Smoothing scales `[heads, D]` from per-channel |k| maxima `[heads, D]`: per RoPE pair (i, i + D/2), the power
    of two nearest (in log2) to (pair max / reference)^alpha, at least 1; `reference` `[heads]` is per head. alpha 1
    flattens every pair down to about the reference; smaller alphas leave part of an outlier in place, which often
    errs less (an outlier that leads its group of 16 is stored almost exactly)."""
    half = channel_amax.shape[-1] // 2
    pair = torch.maximum(channel_amax[..., :half], channel_amax[..., half:])
    ratio = (pair / reference.unsqueeze(-1)).clamp(min=1.0) ** alpha
    scales = torch.exp2(torch.round(torch.log2(ratio)))
    return torch.cat([scales, scales], dim=-1).float()


def save(path: str | Path, model: str, num_kv_heads: int, head_size: int, layers: list[dict],
         key_format: str = "nvfp4") -> None:
    """Write a calibration file; `layers[i]` holds "mode", "key_scales" (tensor or None) and any statistics."""
    rows = []
    for i, layer in enumerate(layers):
        scales = layer.get("key_scales")
        rows.append({**layer, "layer": i,
                     "key_scales": None if scales is None else torch.as_tensor(scales).tolist()})
    Path(path).write_text(json.dumps({"format": FORMAT, "model": model, "num_layers": len(rows),
                                      "num_kv_heads": num_kv_heads, "head_size": head_size,
                                      "key_format": key_format, "layers": rows}))


def load(path: str | Path) -> KVCalibration:
    """Read and check a calibration file: raises CalibrationError naming the file and the broken rule."""
    source = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{source}: cannot read a KV calibration: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CalibrationError(f"{source}: not a KV calibration (format must be {FORMAT!r})")
    for key in ("num_layers", "num_kv_heads", "head_size"):
        if not isinstance(data.get(key), int) or data[key] <= 0:
            raise CalibrationError(f"{source}: {key} must be a positive integer, got {data.get(key)!r}")
    num_layers, heads, head_size = data["num_layers"], data["num_kv_heads"], data["head_size"]
    key_format = data.get("key_format", "nvfp4")
    if key_format not in KEY_FORMATS:
        raise CalibrationError(f"{source}: key_format must be one of {KEY_FORMATS}, got {key_format!r}")
    rows = data.get("layers")
    if not isinstance(rows, list):
        raise CalibrationError(f"{source}: layers must be a list of {num_layers} layer entries")
    by_index: dict[int, dict] = {}
    for row in rows:
        index = row.get("layer") if isinstance(row, dict) else None
        if not isinstance(index, int) or not 0 <= index < num_layers:
            raise CalibrationError(f"{source}: every layer entry needs a layer index in [0, {num_layers}), "
                                   f"got {index!r}")
        if index in by_index:
            raise CalibrationError(f"{source}: layer {index} appears twice")
        by_index[index] = row
    missing = [i for i in range(num_layers) if i not in by_index]
    if missing:
        raise CalibrationError(f"{source}: layer {missing[0]} is missing ({len(missing)} of {num_layers} layers "
                               f"have no entry)")
    policies = []
    for i in range(num_layers):
        row = by_index[i]
        mode = row.get("mode")
        if mode not in LAYER_MODES:
            raise CalibrationError(f"{source}: layer {i}: mode must be one of {LAYER_MODES}, got {mode!r}")
        scales = row.get("key_scales")
        if scales is not None:
            try:
                scales = torch.tensor(scales, dtype=torch.float64)
            except (TypeError, ValueError):
                raise CalibrationError(f"{source}: layer {i}: key_scales must be numbers [{heads}][{head_size}]"
                                       ) from None
            if tuple(scales.shape) != (heads, head_size):
                raise CalibrationError(f"{source}: layer {i}: key_scales must have shape [{heads}, {head_size}], "
                                       f"got {list(scales.shape)}")
            bad = ~torch.isfinite(scales) | (scales <= 0)
            if bad.any():
                h, c = (int(v) for v in bad.nonzero()[0])
                raise CalibrationError(f"{source}: layer {i}: key_scales[{h}][{c}] = {float(scales[h, c])} "
                                       f"is not a positive finite number")
            mantissa, _ = torch.frexp(scales)
            if (mantissa != 0.5).any():
                raise CalibrationError(f"{source}: layer {i}: key_scales must be powers of two (so that k / s and "
                                       f"q * s are exact)")
            half = head_size // 2
            if not torch.equal(scales[:, :half], scales[:, half:]):
                raise CalibrationError(f"{source}: layer {i}: key_scales must be equal on RoPE pairs "
                                       f"(channel c and c + {half})")
            scales = scales.float()
        policies.append(LayerPolicy(mode, scales))
    return KVCalibration(str(data.get("model", "")), heads, head_size, tuple(policies), key_format)

