"""Block-FP8 safetensors checkpoints in the DeepSeek-V3 / Qwen3-FP8 layout.

On disk: ``<name>.weight`` float8_e4m3fn [N, K] + ``<name>.weight_scale_inv`` fp32
[ceil(N/128), ceil(K/128)] for every quantized linear layer, everything else as it was;
shards listed in ``model.safetensors.index.json``; ``config.json`` carries
``quantization_config`` (see ``quantization_config()``), which vLLM and transformers read.

- ``save_fp8_checkpoint`` / ``load_fp8_checkpoint``: a model's state (FP8Linear modules
  included) to and from such a directory.
- ``quantize_checkpoint``: converts a bf16/fp16/fp32 Hugging Face checkpoint shard by shard,
  deciding per tensor whether it is a linear-layer weight (``tensor_role``).
- ``checkpoint_info`` / ``format_checkpoint_info``: what a directory holds, from the
  safetensors headers only (no tensor data is read).
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import nn

from .module import fp8_modules
from .quant import BLOCK, FP8_DTYPE, cdiv, quantize_weight

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size ("5GB")

# safetensors dtype strings -> (torch dtype, bytes per element)
_ST_DTYPES = {
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
    "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2), "F32": (torch.float32, 4),
    "F64": (torch.float64, 8), "I8": (torch.int8, 1), "U8": (torch.uint8, 1),
    "I16": (torch.int16, 2), "I32": (torch.int32, 4), "I64": (torch.int64, 8),
    "BOOL": (torch.bool, 1),
}
_FLOAT_SOURCE = ("BF16", "F16", "F32")  # what quantize_checkpoint converts
# A safetensors header larger than this is corrupt, not a checkpoint (real ones are < 10 MB).
_MAX_HEADER_BYTES = 100 * 2**20


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be read, written or matched to a model."""


def quantization_config(ue8m0: bool = False, ignored_layers: Iterable[str] = ()) -> dict:
    """The ``config.json`` entry DeepSeek-V3 and Qwen3-FP8 checkpoints carry.

    ``scale_fmt: ue8m0`` marks power-of-two scales (DeepSeek-V3.1). ``ignored_layers`` (read
    by vLLM's fp8 config) lists linear layers deliberately left in high precision.
    """
    cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": [BLOCK, BLOCK]}
    if ue8m0:
        cfg["scale_fmt"] = "ue8m0"
    ignored = sorted(set(ignored_layers))
    if ignored:
        cfg["ignored_layers"] = ignored
    return cfg


# ------------------------------------------------------------------ reading a directory
@dataclass
class TensorEntry:
    name: str
    file: Path
    dtype: str          # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ST_DTYPES.get(self.dtype, (None, 0))[1]

    @property
    def torch_dtype(self):
        return _ST_DTYPES.get(self.dtype, (None, 0))[0]


def read_safetensors_header(path) -> dict:
    """{tensor name: {"dtype", "shape", "data_offsets"}} from a file's header, checked for
    consistency with the file size (catches truncated and corrupt files before any load)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            n = int.from_bytes(raw, "little")
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: corrupt safetensors file (header length {n} "
                                      f"does not fit in a {size}-byte file)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors file (header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, meta in header.items():
        try:
            begin, end = meta["data_offsets"]
            shape, dtype = tuple(int(d) for d in meta["shape"]), meta["dtype"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor "
                                  f"'{name}'") from e
        width = _ST_DTYPES.get(dtype, (None, None))[1]
        if end > data_bytes or begin > end or (
                width is not None and end - begin != math.prod(shape) * width):
            raise CheckpointError(f"{path}: corrupt or truncated: tensor '{name}' "
                                  f"(bytes {begin}..{end}) does not fit the file's "
                                  f"{data_bytes} data bytes or its shape {shape} x {dtype}")
    return header


class CheckpointDir:
    """The tensors of a safetensors checkpoint directory: name -> TensorEntry.

    Uses ``model.safetensors.index.json`` when present (and checks it against the shards),
    else ``model.safetensors``, else every ``*.safetensors`` file in the directory.
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory")
        self.index_path = self.path / INDEX_NAME
        self.entries: dict[str, TensorEntry] = {}
        if self.index_path.exists():
            files = self._files_from_index()
        elif (self.path / SINGLE_NAME).exists():
            files = [self.path / SINGLE_NAME]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no safetensors files (expected {INDEX_NAME} "
                                  f"or *.safetensors)")
        self.files = files
        for file in files:
            for name, meta in read_safetensors_header(file).items():
                if name in self.entries:
                    raise CheckpointError(f"{file}: tensor '{name}' is also in "
                                          f"{self.entries[name].file.name}")
                self.entries[name] = TensorEntry(name, file, meta["dtype"],
                                                 tuple(meta["shape"]))
        if self.index_path.exists():
            self._check_index_matches()

    def _files_from_index(self):
        try:
            index = json.loads(self.index_path.read_text())
            self.weight_map = dict(index["weight_map"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{self.index_path}: unreadable index ({e})") from e
        files = []
        for fname in dict.fromkeys(self.weight_map.values()):
            file = self.path / fname
            if not file.exists():
                raise CheckpointError(f"{self.index_path}: lists shard '{fname}', which is "
                                      f"missing from {self.path}")
            files.append(file)
        return files

    def _check_index_matches(self):
        for name, fname in self.weight_map.items():
            e = self.entries.get(name)
            if e is None or e.file.name != fname:
                raise CheckpointError(f"{self.index_path}: tensor '{name}' should be in "
                                      f"'{fname}' but that shard does not hold it")
        unlisted = sorted(set(self.entries) - set(self.weight_map))
        if unlisted:
            raise CheckpointError(f"{self.index_path}: does not list tensor '{unlisted[0]}' "
                                  f"(in {self.entries[unlisted[0]].file.name})"
                                  + (f" and {len(unlisted) - 1} more" if len(unlisted) > 1
                                     else ""))

    def config(self) -> dict:
        p = self.path / CONFIG_NAME
        if not p.exists():
            return {}
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{p}: unreadable config ({e})") from e

    def __contains__(self, name):
        return name in self.entries

    def by_file(self):
        """{file: [names]} in file order: load shard by shard."""
        out: dict[Path, list] = {f: [] for f in self.files}
        for name, e in self.entries.items():
            out[e.file].append(name)
        return out


def _safe_open(file: Path):
    from safetensors import safe_open
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError
        raise CheckpointError(f"{file}: cannot open as safetensors ({e})") from e


def _get_tensor(handle, file: Path, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except Exception as e:
        raise CheckpointError(f"{file}: cannot read tensor '{name}' ({e})") from e


# ------------------------------------------------------------------ model <-> checkpoint
def _unique_state(model: nn.Module):
    """(state name -> tensor, alias groups): names sharing one storage (tied weights, e.g.
    lm_head.weight and embed_tokens.weight) are grouped; one file copy serves the group."""
    state = model.state_dict(keep_vars=True)
    groups: dict[tuple, list] = {}
    for name, t in state.items():
        if t.device.type == "meta":  # no storage: neither loadable nor groupable by address
            raise CheckpointError(f"'{name}' is on the meta device: materialize the model "
                                  f"first, e.g. model.to_empty(device='cpu')")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype,
               t.device) if t.numel() else ("empty", name)
        groups.setdefault(key, []).append(name)
    return state, list(groups.values())


def _power_of_two(t: torch.Tensor) -> bool:
    mant, _ = torch.frexp(t.float())
    return bool((mant == 0.5).all())


def save_fp8_checkpoint(model: nn.Module, path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        config: Optional[dict] = None) -> Path:
    """Write ``model``'s state (FP8Linear layers as weight + weight_scale_inv) to ``path``.

    Shards of at most ``max_shard_bytes`` (a larger single tensor gets a shard of its own),
    ``model.safetensors.index.json``, and ``config.json`` = ``config`` (else the model's
    ``config.to_dict()`` for transformers models, else an existing config.json in ``path``)
    plus ``quantization_config``. Tied tensors are written once. Returns ``path``.
    """
    from safetensors.torch import save_file
    path = Path(path)
    mods = fp8_modules(model)
    if not mods:
        raise CheckpointError("the model has no FP8Linear layers: run "
                              "fp8linear.quantize_model(model) before saving")
    for name, mod in mods:
        mod.validate(name)
    state, groups = _unique_state(model)
    names = [g[0] for g in groups]  # the first name of each tied group is the one on disk
    path.mkdir(parents=True, exist_ok=True)

    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    total = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = SINGLE_NAME if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        tensors = {n: state[n].detach().to("cpu").contiguous() for n in shard}
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total_size = sum(state[n].numel() * state[n].element_size() for n in names)
    _write_json(path / INDEX_NAME, {"metadata": {"total_size": total_size},
                                    "weight_map": weight_map})

    if config is None:
        if hasattr(getattr(model, "config", None), "to_dict"):
            config = model.config.to_dict()
        elif (path / CONFIG_NAME).exists():
            config = json.loads((path / CONFIG_NAME).read_text())
        else:
            config = {}
    ue8m0 = all(_power_of_two(m.weight_scale_inv) for _, m in mods)
    config = dict(config, quantization_config=quantization_config(ue8m0))
    _write_json(path / CONFIG_NAME, config)
    return path


def load_fp8_checkpoint(model: nn.Module, path, strict: bool = True) -> nn.Module:
    """Fill ``model`` (FP8Linear layers, e.g. after ``quantize_model``, and everything else
    in its state_dict) from the checkpoint directory ``path``, tensor by tensor.

    FP8Linear weights must be float8_e4m3fn and their scales fp32 in the file, with the
    layer's shape (scales: 128x128 blocks or per row); other floating tensors are cast to the
    model's dtype. A missing tensor, wrong shape or dtype, or (with ``strict``) a tensor the
    model does not have raises CheckpointError naming the tensor and the file. Every
    FP8Linear is validated once afterwards (non-finite scales are caught there).
    """
    ckpt = CheckpointDir(path)
    state, groups = _unique_state(model)
    fp8 = dict(fp8_modules(model))
    where = ckpt.index_path if ckpt.index_path.exists() else ckpt.path

    # every tied group needs one copy on disk; missing tensors are reported before any load
    plan: dict[str, list] = {}  # checkpoint name -> model names it fills
    for group in groups:
        present = [n for n in group if n in ckpt]
        if not present:
            hint = ""
            owner, _, leaf = group[0].rpartition(".")
            if leaf == "weight_scale_inv" or (leaf == "weight" and owner in fp8):
                hint = " (is the checkpoint quantized? convert it with `fp8linear quantize`)"
            raise CheckpointError(f"tensor '{group[0]}' is missing from the checkpoint "
                                  f"({where}){hint}")
        for n in present:
            plan[n] = group
    if strict:
        extra = sorted(set(ckpt.entries) - set(plan))
        if extra:
            e = ckpt.entries[extra[0]]
            raise CheckpointError(
                f"{e.file}: tensor '{e.name}' is not in the model"
                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                + "; was quantize_model run with the same skip list? "
                  "(load_fp8_checkpoint(..., strict=False) ignores extra tensors)")
    for name in plan:
        for target in plan[name]:
            _check_entry(ckpt.entries[name], target, state[target], fp8)

    with torch.no_grad():
        for file, names in ckpt.by_file().items():
            names = [n for n in names if n in plan]
            if not names:
                continue
            handle = _safe_open(file)
            for name in names:
                t = _get_tensor(handle, file, name)
                for target in plan[name]:
                    _assign(model, target, state[target], t, fp8)
    for name, mod in fp8.items():
        try:
            mod.validate(name)
        except ValueError as e:
            file = ckpt.entries[f"{name}.weight_scale_inv" if name else "weight_scale_inv"].file
            raise CheckpointError(f"{file}: {e}") from e
    return model


def _check_entry(entry: TensorEntry, target: str, param: torch.Tensor, fp8: dict):
    owner, _, leaf = target.rpartition(".")
    where = f"{entry.file}: tensor '{entry.name}'"
    if owner in fp8 and leaf in ("weight", "weight_scale_inv"):
        mod = fp8[owner]
        if leaf == "weight":
            want_dtype, want = FP8_DTYPE, [(mod.out_features, mod.in_features)]
        else:
            kb = cdiv(mod.in_features, BLOCK)
            want_dtype = torch.float32
            want = [(cdiv(mod.out_features, BLOCK), kb), (mod.out_features, kb)]
        if entry.torch_dtype != want_dtype:
            raise CheckpointError(f"{where} is {entry.dtype}, the FP8Linear layer '{owner}' "
                                  f"expects {want_dtype}")
        if entry.shape not in want:
            raise CheckpointError(f"{where} has shape {list(entry.shape)}, the FP8Linear "
                                  f"layer '{owner}' expects "
                                  + " or ".join(str(list(w)) for w in want))
        return
    if entry.shape != tuple(param.shape):
        raise CheckpointError(f"{where} has shape {list(entry.shape)}, the model expects "
                              f"{list(param.shape)}")
    src = entry.torch_dtype
    if src in (FP8_DTYPE, torch.float8_e5m2) and param.dtype != src:
        raise CheckpointError(f"{where} is {entry.dtype} (quantized) but the model's "
                              f"'{target}' is {param.dtype}: run fp8linear.quantize_model "
                              f"on the model first (with the same skip list)")
    if src is None or src.is_floating_point != param.dtype.is_floating_point or (
            not src.is_floating_point and src != param.dtype):
        raise CheckpointError(f"{where} is {entry.dtype}, the model expects {param.dtype}")


def _assign(model, target, param, t, fp8):
    owner, _, leaf = target.rpartition(".")
    if owner in fp8 and leaf == "weight_scale_inv" and tuple(t.shape) != tuple(param.shape):
        # per-row scales (tensor-parallel shards not aligned to 128): take the file's shape
        param.data = t.to(device=param.device, dtype=torch.float32).contiguous()
        return
    param.copy_(t)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


# ------------------------------------------------------------------ which tensors to quantize
_ROUTER_NAMES = ("gate", "router", "routing", "gating")


def _pattern_match(name: str, patterns: Iterable[str]) -> Optional[str]:
    """Same rule as quantize_model's skip: a plain substring or an fnmatch pattern, tested on
    the tensor name and its module name."""
    module = name[:-len(".weight")] if name.endswith(".weight") else name
    for p in patterns:
        if p in name or fnmatch.fnmatch(name, p) or fnmatch.fnmatch(module, p):
            return p
    return None


def _text_config_value(config: dict, *keys):
    """A key from config.json or, for multimodal models, from its text_config."""
    for cfg in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        for k in keys:
            if isinstance(cfg, dict) and cfg.get(k) is not None:
                return cfg[k]
    return None


def tensor_role(name: str, shape, dtype: str, config: Optional[dict] = None,
                skip: Iterable[str] = ()) -> tuple[bool, str]:
    """(quantize?, reason) for one checkpoint tensor, for any architecture.

    Quantized: 2-D bf16/fp16/fp32 ``*.weight`` matrices of linear layers (attention, MLP,
    MoE experts and shared experts). Kept: anything not 2-D (norms, biases, conv kernels,
    fused 3-D expert stacks), non-``.weight`` tensors, embeddings, the output head
    (``lm_head``, any vocabulary-sized matrix, tied output embeddings), MoE routers (kept in
    high precision, as the DeepSeek-V3 and Qwen3 FP8 checkpoints keep them) and ``skip``
    matches.
    """
    config = config or {}
    parts = name.split(".")
    module_parts = parts[:-1]
    if dtype in ("F8_E4M3", "F8_E5M2"):
        raise CheckpointError(f"tensor '{name}' is already {dtype}: the input checkpoint "
                              f"is quantized")
    if dtype not in _FLOAT_SOURCE:
        return False, f"{dtype} (not bf16/fp16/fp32)"
    if len(shape) != 2:
        return False, f"{len(shape)}-D (only 2-D linear weights are quantized)"
    if parts[-1] != "weight":
        return False, "not a .weight tensor"
    pat = _pattern_match(name, skip)
    if pat is not None:
        return False, f"matches --skip {pat!r}"
    lowered = [p.lower() for p in module_parts]
    if any("embed" in p or p in ("wte", "wpe", "shared") for p in lowered):
        return False, "embedding"
    if any(p == "lm_head" for p in lowered) or name == "output.weight":
        tied = " (tied to the input embeddings)" if _text_config_value(
            config, "tie_word_embeddings") else ""
        return False, f"output head{tied}"
    if any("norm" in p or p.startswith("ln") for p in lowered):
        return False, "normalization"
    # Heads and embeddings live outside the repeated blocks: a vocabulary-sized matrix with
    # no layer index in its name is one of them (an MLP whose width happens to equal the
    # vocabulary, inside layer i, is not).
    vocab = _text_config_value(config, "vocab_size")
    if vocab and int(shape[0]) == int(vocab) and not any(p.isdigit() for p in module_parts):
        return False, "vocabulary-sized matrix outside the layers (embedding or output head)"
    if module_parts and (lowered[-1] in _ROUTER_NAMES or "router" in lowered[-1]):
        return False, "MoE router"
    return True, "linear weight"


# ------------------------------------------------------------------ the converter
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


def quantize_checkpoint(in_dir, out_dir, skip: Iterable[str] = (), ue8m0: bool = False,
                        force: bool = False, progress: bool = True) -> QuantizeReport:
    """Convert a bf16/fp16/fp32 safetensors checkpoint to block FP8, one shard at a time.

    Each input shard becomes an output shard of the same name (peak memory: one shard and
    its output). Tensors are chosen by ``tensor_role``. Non-weight files (tokenizer,
    generation config, custom code) are copied; config.json gains ``quantization_config``.
    The output is written to a temporary directory beside ``out_dir``, validated
    (``validate_quantized_checkpoint``), then moved into place. An existing ``out_dir`` is
    only replaced with ``force``.
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

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
    config = src.config()
    if config.get("quantization_config"):
        raise CheckpointError(f"{src.path / CONFIG_NAME}: the checkpoint is already quantized "
                              f"(quantization_config: {config['quantization_config']})")
    skip = tuple(skip)

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
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.tmp-", dir=out_path.parent))
    try:
        weight_map = {}
        bar = tqdm(total=len(src.entries), unit="tensor", desc="quantizing",
                   disable=not progress)
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
        bar.close()
        _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": report.bytes_out},
                                       "weight_map": weight_map})
        ignored = [n[:-len(".weight")] for n, r in report.kept.items()
                   if r.startswith(("matches --skip", "MoE router"))]
        config = dict(config, quantization_config=quantization_config(ue8m0, ignored))
        _write_json(tmp / CONFIG_NAME, config)
        report.files_copied = _copy_other_files(src.path, tmp, skip={tmp, out_path})
        validate_quantized_checkpoint(tmp, src)
        if out_path.exists():
            shutil.rmtree(out_path)
        os.replace(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


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
    if source is not None:
        for name, e in source.entries.items():
            got = ckpt.entries.get(name)
            if got is None or got.shape != e.shape:
                raise CheckpointError(f"{ckpt.path}: tensor '{name}' of the input "
                                      f"({list(e.shape)}) is "
                                      + (f"{list(got.shape)}" if got else "missing"))


# ------------------------------------------------------------------ fp8linear info
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


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else str(n)
