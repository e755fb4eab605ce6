"""``fp8linear info``: what a checkpoint directory holds, from the safetensors headers only
(no tensor data is read)."""
from __future__ import annotations

from .format import SCALE_SUFFIX, _fmt_bytes, _fmt_count
from .io import CheckpointDir


def checkpoint_info(path) -> dict:
    """What a checkpoint directory holds, read from headers only."""
    ckpt = CheckpointDir(path)
    cfg = ckpt.config()
    qcfg = cfg.get("quantization_config") or {}
    fp8_weights = {n: e for n, e in ckpt.entries.items() if e.dtype == "F8_E4M3"}
    scales = {n + SCALE_SUFFIX for n in fp8_weights if n + SCALE_SUFFIX in ckpt.entries}
    others = {n: e for n, e in ckpt.entries.items()
              if n not in fp8_weights and n not in scales}
    bytes_by_dtype: dict[str, int] = {}
    for e in ckpt.entries.values():
        bytes_by_dtype[e.dtype] = bytes_by_dtype.get(e.dtype, 0) + e.nbytes
    return {
        "path": str(ckpt.path),
        "files": [{"name": f.name, "bytes": f.stat().st_size} for f in ckpt.files],
        "indexed": ckpt.index_path.exists(),
        "architectures": cfg.get("architectures"),
        "quantization_config": qcfg or None,
        "block_size": qcfg.get("weight_block_size"),
        "scale_fmt": qcfg.get("scale_fmt", "fp32" if qcfg else None),
        "quantized_tensors": len(fp8_weights),
        "quantized_params": sum(e.numel for e in fp8_weights.values()),
        "scale_tensors": len(scales),
        "fp8_without_scale": sorted(n for n in fp8_weights if n + SCALE_SUFFIX not in scales),
        "unquantized_tensors": len(others),
        "unquantized_params": sum(e.numel for e in others.values()),
        "unquantized_2d_weights": sorted(n for n, e in others.items()
                                         if len(e.shape) == 2 and n.endswith(".weight")),
        "bytes_by_dtype": bytes_by_dtype,
        "total_bytes": sum(bytes_by_dtype.values()),
    }


def format_checkpoint_info(info: dict) -> str:
    q = info["quantization_config"]
    lines = [f"checkpoint   {info['path']}",
             f"files        {len(info['files'])} safetensors"
             + (" (+ index)" if info["indexed"] else "")
             + f", {_fmt_bytes(sum(f['bytes'] for f in info['files']))} on disk"]
    if info["architectures"]:
        lines.append(f"architecture {', '.join(info['architectures'])}")
    if q:
        lines.append(f"quantization {q.get('quant_method')} {q.get('fmt')}, blocks "
                     f"{'x'.join(str(b) for b in info['block_size'] or [])}, scales "
                     f"{info['scale_fmt']}, activations {q.get('activation_scheme')}")
    else:
        lines.append("quantization none (no quantization_config in config.json)")
    lines.append(f"quantized    {info['quantized_tensors']} fp8 weights "
                 f"({_fmt_count(info['quantized_params'])} params), "
                 f"{info['scale_tensors']} scale tensors")
    lines.append(f"unquantized  {info['unquantized_tensors']} tensors "
                 f"({_fmt_count(info['unquantized_params'])} params), of which "
                 f"{len(info['unquantized_2d_weights'])} 2-D weights")
    lines.append("bytes        " + ", ".join(f"{d} {_fmt_bytes(b)}" for d, b in
                                             sorted(info["bytes_by_dtype"].items()))
                 + f"; total {_fmt_bytes(info['total_bytes'])}")
    if info["fp8_without_scale"]:
        lines.append(f"WARNING      {len(info['fp8_without_scale'])} fp8 weights without "
                     f"a scale, e.g. {info['fp8_without_scale'][0]}")
    return "\n".join(lines)

