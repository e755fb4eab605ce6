"""``fp8linear info``: what a checkpoint directory holds and whether its fp8 weights and
scales fit together, from the safetensors headers only (no tensor data is read)."""
from __future__ import annotations

from ..quant import weight_scale_shapes
from .format import SCALE_SUFFIX, _fmt_bytes, _fmt_count
from .io import CheckpointDir

_SCALE_DTYPES = ("F32", "BF16", "F16")  # what load_fp8_checkpoint accepts


def checkpoint_info(path) -> dict:
    """What a checkpoint directory holds, read from headers only. ``problems``: one line
    per fp8 weight whose scale is missing or of the wrong shape or dtype, and per scale
    without an fp8 weight (the checkpoint would not load)."""
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
        "problems": scale_problems(ckpt),
    }


def scale_problems(ckpt: CheckpointDir) -> list:
    problems = []
    for name, e in ckpt.entries.items():
        if e.dtype == "F8_E4M3":
            sname = name + SCALE_SUFFIX
            s = ckpt.entries.get(sname)
            if len(e.shape) < 2:
                problems.append(f"{e.file}: fp8 tensor '{name}' has shape {list(e.shape)}; "
                                f"block-FP8 weights are at least 2-D")
                continue
            # [..., N, K] (stacked experts keep their leading dims)
            *lead, n, k = e.shape
            blocks, rows = ([*lead, *w] for w in weight_scale_shapes(n, k))
            if s is None or s.dtype not in _SCALE_DTYPES or list(s.shape) not in (blocks, rows):
                problems.append(f"{e.file}: fp8 tensor '{name}' {list(e.shape)} needs an F32 "
                                f"scale '{sname}' of shape {blocks} (128x128 blocks) or "
                                f"{rows} (per row), found "
                                + (f"{s.dtype} {list(s.shape)}" if s else "none"))
        elif name.endswith(SCALE_SUFFIX):
            w = ckpt.entries.get(name[:-len(SCALE_SUFFIX)])
            if w is None or w.dtype != "F8_E4M3":
                problems.append(f"{e.file}: scale '{name}' belongs to no fp8 tensor (its "
                                f"weight is " + (w.dtype if w else "missing") + ")")
    return problems


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
    for problem in info["problems"][:3]:
        lines.append(f"PROBLEM      {problem}")
    if len(info["problems"]) > 3:
        lines.append(f"PROBLEM      ... and {len(info['problems']) - 3} more")
    return "\n".join(lines)

