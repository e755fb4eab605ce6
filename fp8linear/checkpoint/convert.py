"""The converter behind ``fp8linear quantize``: a bf16/fp16/fp32 Hugging Face safetensors
checkpoint to block FP8, shard by shard, written beside the target and validated before it
is moved into place."""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import socket
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..quant import BLOCK, cdiv, quantize_weight
from .format import (CONFIG_NAME, INDEX_NAME, SCALE_SUFFIX, CheckpointError, CheckpointWarning,
                     _fmt_bytes, _pattern_match, quantization_config, tensor_role)
from .io import CheckpointDir, _get_tensor, _safe_open, _write_json, write_index, written_files


@dataclass
class QuantizeReport:
    out_dir: Path
    quantized: list = field(default_factory=list)            # tensor names
    kept: dict = field(default_factory=dict)                 # name -> reason
    bytes_in: int = 0
    bytes_out: int = 0
    files_copied: list = field(default_factory=list)

    def summary(self) -> str:
        ratio = self.bytes_out / self.bytes_in if self.bytes_in else float("nan")
        reasons: dict[str, int] = {}
        for r in self.kept.values():
            reasons[r] = reasons.get(r, 0) + 1
        lines = [f"wrote {self.out_dir}",
                 f"  quantized {len(self.quantized)} linear weights to block FP8 (128x128)",
                 f"  kept {len(self.kept)} tensors as they were"]
        lines += [f"    {n:5d} {r}" for r, n in sorted(reasons.items(), key=lambda x: -x[1])]
        lines.append(f"  tensor bytes {_fmt_bytes(self.bytes_in)} -> "
                     f"{_fmt_bytes(self.bytes_out)} ({ratio:.1%})")
        if self.files_copied:
            lines.append(f"  copied {', '.join(self.files_copied)}")
        return "\n".join(lines)


# weight formats other than safetensors are never copied: they would duplicate the weights
_NEVER_COPY = ("*.safetensors", INDEX_NAME, CONFIG_NAME, "*.bin", "*.bin.index.json", "*.pt",
               "*.pth", "*.gguf", "*.ckpt", "*.h5", "*.msgpack")


def quantize_checkpoint(in_dir, out_dir, skip: Iterable[str] | str = (), ue8m0: bool = False,
                        force: bool = False, progress: bool = True) -> QuantizeReport:
    """Convert a bf16/fp16/fp32 safetensors checkpoint to block FP8, one shard at a time.

    Each input shard becomes an output shard of the same name (peak memory: one shard and
    its output). Tensors are chosen by ``tensor_role``; ``skip`` patterns (a string is one
    pattern) keep matching tensors as they are. Non-weight files (tokenizer, generation
    config, custom code) are copied; config.json gains ``quantization_config``. The output
    is written to a temporary directory beside ``out_dir`` (with the umask's permissions),
    validated (``validate_quantized_checkpoint``), then moved into place; an interruption
    removes it, and temporary directories that a killed run left are removed by the next.
    An existing ``out_dir`` is only replaced with ``force``, and only when it holds nothing
    but a checkpoint fp8linear wrote. A missing config.json and a skip pattern that matches
    nothing give a CheckpointWarning.
    """
    src = CheckpointDir(in_dir)
    in_path, out_path = src.path.resolve(), Path(out_dir).resolve()
    if out_path == in_path or out_path in in_path.parents:
        raise CheckpointError(f"output directory {out_path} would overwrite the input "
                              f"checkpoint {in_path}")
    if out_path.exists() and not force:
        raise CheckpointError(f"{out_path} already exists: pass --force (force=True) to "
                              f"replace it")
    if out_path.exists() and not out_path.is_dir():
        raise CheckpointError(f"{out_path} exists and is not a directory")
    if out_path.exists():
        _check_replaceable(out_path)
    config = src.config()
    if config.get("quantization_config"):
        raise CheckpointError(f"{src.path / CONFIG_NAME}: the checkpoint is already quantized "
                              f"(quantization_config: {config['quantization_config']})")
    if not (src.path / CONFIG_NAME).exists():
        warnings.warn(f"{src.path / CONFIG_NAME} is missing: the output's config.json will "
                      f"hold only quantization_config (vLLM and transformers also need the "
                      f"model's own config)", CheckpointWarning, stacklevel=2)
    skip = (skip,) if isinstance(skip, str) else tuple(skip)
    for pattern in skip:
        if not any(_pattern_match(name, (pattern,)) for name in src.entries):
            warnings.warn(f"skip pattern {pattern!r} matches no tensor in {src.path}",
                          CheckpointWarning, stacklevel=2)

    report = QuantizeReport(out_path)
    plan = {}
    for name, e in src.entries.items():
        q, reason = tensor_role(name, e.shape, e.dtype, config, skip)
        plan[name] = q
        if q:
            if name + SCALE_SUFFIX in src.entries:
                raise CheckpointError(f"{e.file}: tensor '{name}{SCALE_SUFFIX}' already exists")
            report.quantized.append(name)
        else:
            report.kept[name] = reason
    if not report.quantized:
        raise CheckpointError(f"{src.path}: found no linear-layer weights to quantize "
                              f"(kept: {_first_reasons(report.kept)})")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp(out_path)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out_path), dir=out_path.parent))
    try:
        # mkdtemp makes the folder 0700: a server under another account could not read it
        os.chmod(tmp, 0o777 & ~_umask())
        weight_map = _convert_shards(src, tmp, plan, ue8m0, progress, report)
        report.files_copied = _copy_other_files(src.path, tmp, skip={tmp, out_path})
        write_index(tmp, weight_map, report.bytes_out, report.files_copied)
        ignored = [n[:-len(".weight")] for n, r in report.kept.items()
                   if r.startswith(("matches --skip", "MoE router"))]
        config = dict(config, quantization_config=quantization_config(ue8m0, ignored))
        _write_json(tmp / CONFIG_NAME, config)
        validate_quantized_checkpoint(tmp, src)
        swap_in(tmp, out_path)
    except BaseException:  # KeyboardInterrupt too: never leave a partial output behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def swap_in(tmp: Path, out: Path) -> None:
    """The finished folder ``tmp`` becomes ``out``; an old ``out`` is renamed away first and
    deleted after, so it is never half deleted."""
    if out.exists():
        old = tmp.with_name(tmp.name + "-old")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


def _convert_shards(src: CheckpointDir, tmp: Path, plan: dict, ue8m0: bool, progress: bool,
                    report: QuantizeReport) -> dict:
    """Each input shard to an output shard of the same name in ``tmp``; the weight map."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    weight_map = {}
    with tqdm(total=len(src.entries), unit="tensor", desc="quantizing",
              disable=not progress) as bar:
        for file, names in src.by_file().items():
            handle = _safe_open(file)
            out: dict[str, torch.Tensor] = {}
            for name in names:
                t = _get_tensor(handle, file, name)
                report.bytes_in += t.numel() * t.element_size()
                if plan[name]:
                    try:
                        q, s = quantize_weight(t, ue8m0=ue8m0)
                    except ValueError as e:
                        raise CheckpointError(f"{file}: tensor '{name}': {e}") from e
                    out[name], out[name + SCALE_SUFFIX] = q, s
                else:
                    out[name] = t.contiguous()
                bar.update(1)
            del handle
            save_file(out, str(tmp / file.name), metadata={"format": "pt"})
            report.bytes_out += sum(t.numel() * t.element_size() for t in out.values())
            weight_map.update({n: file.name for n in out})
            del out
    return weight_map


def _check_replaceable(out_path: Path) -> None:
    """--force deletes ``out_path`` only when it holds nothing fp8linear did not write."""
    entries = sorted(p.name for p in out_path.iterdir())
    if not entries:
        return
    ours = written_files(out_path)
    if ours is None:
        raise CheckpointError(f"{out_path} is not a checkpoint written by fp8linear (its "
                              f"{INDEX_NAME} lists no files fp8linear wrote): --force "
                              f"replaces only those; remove it yourself or pick another "
                              f"output directory")
    foreign = [e for e in entries if e not in ours]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise CheckpointError(f"{out_path} holds '{foreign[0]}'{more}, which fp8linear did "
                              f"not write: --force replaces only a folder holding just a "
                              f"checkpoint it wrote; move those files or pick another output "
                              f"directory")


# ".OUT.tmp-<host>-<pid>-<random>[-old]": which run made it, so the next run can tell a
# killed run's leftovers from a run still writing
_TEMP_RE = re.compile(r"\.tmp-(?P<host>.+)-(?P<pid>\d+)-[A-Za-z0-9_]+(?:-old)?$")


def _temp_prefix(out_path: Path) -> str:
    return f".{out_path.name}.tmp-{socket.gethostname()}-{os.getpid()}-"


def _remove_stale_temp(out_path: Path) -> None:
    prefix = f".{out_path.name}.tmp-"
    for p in sorted(out_path.parent.iterdir()):
        if not p.name.startswith(prefix) or not p.is_dir():
            continue
        m = _TEMP_RE.match(p.name, len(out_path.name) + 1)
        if m and m["host"] == socket.gethostname() and not _pid_alive(int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)
            warnings.warn(f"removed {p}, left by an interrupted fp8linear quantize",
                          CheckpointWarning, stacklevel=3)
        else:
            warnings.warn(f"{p} may belong to another fp8linear quantize of {out_path} "
                          f"(still running, or on another machine): not removed; delete it "
                          f"if no such run is going on", CheckpointWarning, stacklevel=3)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, under another user
        return True
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _first_reasons(kept: dict, n: int = 3) -> str:
    return ", ".join(f"{k}: {v}" for k, v in list(kept.items())[:n]) or "no tensors"


def _copy_other_files(src: Path, dst: Path, skip=()) -> list:
    """Top-level files and folders of ``src`` except weights, config and hidden entries
    (.git, caches, our own temporary folder); never ``skip`` (an output inside the input)."""
    copied = []
    skip = {Path(p).resolve() for p in skip}
    for p in sorted(src.iterdir()):
        if (p.name.startswith(".") or p.resolve() in skip
                or any(fnmatch.fnmatch(p.name, pat) for pat in _NEVER_COPY)):
            continue
        if p.is_dir():
            shutil.copytree(p, dst / p.name)
        else:
            shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    return copied


def validate_quantized_checkpoint(path, source: Optional[CheckpointDir] = None) -> None:
    """Re-open every shard and check what a converter wrote: the index lists every tensor
    in the shard that holds it (CheckpointDir does that), each fp8 weight has an fp32 scale
    of the block shape whose values are finite, and (given ``source``) every input tensor
    is there with its shape."""
    ckpt = CheckpointDir(path)
    cfg = ckpt.config().get("quantization_config") or {}
    if cfg.get("quant_method") != "fp8" or list(cfg.get("weight_block_size", [])) != [BLOCK,
                                                                                      BLOCK]:
        raise CheckpointError(f"{ckpt.path / CONFIG_NAME}: quantization_config {cfg} is not "
                              f"fp8 with weight_block_size [128, 128]")
    for name, e in ckpt.entries.items():
        if e.dtype == "F8_E4M3":
            sname = name + SCALE_SUFFIX
            s = ckpt.entries.get(sname)
            if len(e.shape) < 2:
                raise CheckpointError(f"{e.file}: fp8 tensor '{name}' has shape "
                                      f"{list(e.shape)}; block-FP8 weights are at least 2-D")
            # [..., N, K] (stacked experts keep their leading dims): a scale per 128x128 block
            *lead, n, k = e.shape
            want = (*lead, cdiv(n, BLOCK), cdiv(k, BLOCK))
            if s is None or s.dtype != "F32" or s.shape != want:
                raise CheckpointError(f"{e.file}: fp8 tensor '{name}' needs an F32 '{sname}' "
                                      f"of shape {list(want)}, found "
                                      + (f"{s.dtype} {list(s.shape)}" if s else "none"))
    for file, names in ckpt.by_file().items():
        handle = _safe_open(file)
        for name in names:
            if name.endswith(SCALE_SUFFIX):
                t = _get_tensor(handle, file, name)
                if not torch.isfinite(t).all():
                    raise CheckpointError(f"{file}: tensor '{name}' has non-finite scales")
                if (t <= 0).any():
                    raise CheckpointError(f"{file}: tensor '{name}' has scales <= 0 (scales "
                                          f"must be positive)")
    if source is not None:
        for name, e in source.entries.items():
            got = ckpt.entries.get(name)
            if got is None or got.shape != e.shape:
                raise CheckpointError(f"{ckpt.path}: tensor '{name}' of the input "
                                      f"({list(e.shape)}) is "
                                      + (f"{list(got.shape)}" if got else "missing"))

