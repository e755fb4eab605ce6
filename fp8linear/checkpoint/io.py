"""Reading and writing block-FP8 safetensors checkpoints: headers checked against file
sizes, the shard index, and a model's state to and from a directory
(``save_fp8_checkpoint`` / ``load_fp8_checkpoint``).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..version import __version__
from ..experts import FP8Experts
from ..module import FP8Linear, fp8_modules
from ..quant import BLOCK, FP8_DTYPE, SCALE_LOAD_DTYPES, cdiv, check_scale_values
from .format import (_ST_DTYPES, CONFIG_NAME, DEFAULT_MAX_SHARD_BYTES, INDEX_NAME, SINGLE_NAME,
                     CheckpointError, TensorEntry, quantization_config)
from .hf_names import to_checkpoint, to_model

# A safetensors header larger than this is corrupt, not a checkpoint (real ones are < 10 MB).
_MAX_HEADER_BYTES = 100 * 2**20


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
    """Write ``model``'s state (FP8Linear layers as weight + weight_scale_inv, FP8Experts
    expert by expert: ``<j>.gate_proj.weight`` + ``weight_scale_inv``, ...) to ``path``.

    Shards of at most ``max_shard_bytes`` (a larger single tensor gets a shard of its own),
    ``model.safetensors.index.json``, and ``config.json`` = ``config`` (else the model's
    ``config.to_dict()`` for transformers models, else an existing config.json in ``path``)
    plus ``quantization_config``. Tied tensors are written once; a transformers model's
    tensors under the names its checkpoints use (``hf_names``). Returns ``path``.
    """
    from safetensors.torch import save_file
    path = Path(path)
    mods = fp8_modules(model)
    if not mods:
        raise CheckpointError("the model has no FP8Linear or FP8Experts layers: run "
                              "fp8linear.quantize_model(model) before saving")
    for name, mod in mods:
        mod.validate(name)
    state, groups = _unique_state(model)
    names = [g[0] for g in groups]  # the first name of each tied group is the one on disk
    disk = to_checkpoint(model)  # (a transformers model: the names its checkpoints use)
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
        tensors = {disk(n): state[n].detach().to("cpu").contiguous() for n in shard}
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    total_size = sum(state[n].numel() * state[n].element_size() for n in names)
    # shards an earlier save left here are still fp8linear's (a later --force may remove them)
    earlier = (written_files(path) or set()) & {p.name for p in path.iterdir()}
    write_index(path, weight_map, total_size, earlier)

    if config is None:
        if hasattr(getattr(model, "config", None), "to_dict"):
            config = model.config.to_dict()
        elif (path / CONFIG_NAME).exists():
            config = json.loads((path / CONFIG_NAME).read_text())
        else:
            config = {}
    ue8m0 = all(_power_of_two(s) for _, m in mods for s in m.scales())
    config = dict(config, quantization_config=quantization_config(ue8m0))
    _write_json(path / CONFIG_NAME, config)
    return path


def load_fp8_checkpoint(model: nn.Module, path, strict: bool = True) -> nn.Module:
    """Fill ``model`` (FP8Linear and FP8Experts layers, e.g. after ``quantize_model``, and
    everything else in its state_dict) from the checkpoint directory ``path``, tensor by
    tensor (a transformers model's names renamed by its rules: ``hf_names``).

    FP8 weights must be float8_e4m3fn in the file and their scales fp32 (bf16/fp16 convert
    exactly), with the layer's shape (FP8Linear scales: 128x128 blocks or per row), finite
    and positive; other floating tensors are cast to the model's dtype. Buffers the
    checkpoint lacks keep the values the model computed (position ids, rotary tables), and
    the checkpoint's copies of non-persistent buffers are ignored. A missing tensor, wrong
    shape, dtype or scale value, or (with ``strict``) a tensor the model does not have
    raises CheckpointError naming the tensor and the file, before anything is copied.
    """
    ckpt = CheckpointDir(path)
    state, groups = _unique_state(model)
    rename = to_model(model)  # (a transformers model: its checkpoints' names, renamed)
    on_disk = {}
    for name in ckpt.entries:
        on_disk.setdefault(rename(name), name)
    fp8 = {n: m for n, m in fp8_modules(model) if isinstance(m, FP8Linear)}
    experts = _expert_tensors(model)
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    where = ckpt.index_path if ckpt.index_path.exists() else ckpt.path

    # every tied group needs one copy on disk; missing tensors are reported before any load
    plan: dict[str, list] = {}  # checkpoint name -> model names it fills
    for group in groups:
        present = [n for n in group if n in on_disk]
        if not present:
            if all(n in buffers for n in group):
                continue  # a buffer the model computes itself (e.g. BERT's position_ids)
            raise CheckpointError(f"tensor '{group[0]}' is missing from the checkpoint "
                                  f"({where}){_missing_hint(group[0], ckpt, fp8)}")
        for n in present:
            plan[on_disk[n]] = group
    if strict:
        # a non-persistent buffer (not in state_dict) that an older save wrote is not extra
        extra = sorted(n for n in ckpt.entries if n not in plan and rename(n) not in buffers)
        if extra:
            e = ckpt.entries[extra[0]]
            raise CheckpointError(
                f"{e.file}: tensor '{e.name}' is not in the model"
                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                + _extra_hint(e.name, model))
    for name in plan:
        for target in plan[name]:
            _check_entry(ckpt.entries[name], target, state[target], fp8, experts)

    # scales are small: read and check them all first, so a bad one leaves the model as it was
    scales = {}
    for file, names in ckpt.by_file().items():
        names = [n for n in names if n in plan and _is_fp8_scale(plan[n], fp8, experts)]
        handle = _safe_open(file) if names else None
        for name in names:
            scales[name] = _get_tensor(handle, file, name)
            try:
                check_scale_values(scales[name], name)
            except ValueError as e:
                raise CheckpointError(f"{file}: {e}") from e

    with torch.no_grad():
        for file, names in ckpt.by_file().items():
            names = [n for n in names if n in plan]
            if not names:
                continue
            handle = _safe_open(file)
            for name in names:
                t = scales[name] if name in scales else _get_tensor(handle, file, name)
                for target in plan[name]:
                    _assign(target, state[target], t, fp8)
    return model


def _expert_tensors(model: nn.Module) -> dict:
    """state name -> "weight" or "scale" for the FP8Experts layers' per-expert tensors."""
    return {f"{name}.{key}": "scale" if key.endswith("_scale_inv") else "weight"
            for name, m in model.named_modules() if isinstance(m, FP8Experts)
            for key, _ in m.state_items()}


def _is_fp8_scale(targets, fp8, experts) -> bool:
    parts = [t.rpartition(".") for t in targets]
    return any(leaf == "weight_scale_inv" and owner in fp8 for owner, _, leaf in parts) or any(
        experts.get(t) == "scale" for t in targets)


def _missing_hint(name: str, ckpt: CheckpointDir, fp8: dict) -> str:
    owner, _, leaf = name.rpartition(".")
    if owner not in fp8 or leaf not in ("weight", "weight_scale_inv"):
        return ""
    if not any(e.dtype == "F8_E4M3" for e in ckpt.entries.values()):
        return " (the checkpoint is not quantized: convert it with `fp8linear quantize`)"
    w = ckpt.entries.get(f"{owner}.weight" if owner else "weight")
    if w is not None and w.dtype != "F8_E4M3":
        return (f" (the checkpoint keeps '{owner}' unquantized, as {w.dtype}: pass "
                f"quantize_model a skip list that leaves it out)")
    return ""


def _extra_hint(name: str, model: nn.Module) -> str:
    owner, _, leaf = name.rpartition(".")
    if leaf == "weight_scale_inv":
        try:
            kind = type(model.get_submodule(owner)).__name__
        except AttributeError:
            kind = None
        if kind is not None:
            return (f"; the checkpoint quantizes '{owner}' but the model's layer is a {kind}: "
                    f"run fp8linear.quantize_model without skipping it")
    return "; load_fp8_checkpoint(..., strict=False) ignores extra tensors"


def _check_entry(entry: TensorEntry, target: str, param: torch.Tensor, fp8: dict,
                 experts: dict):
    owner, _, leaf = target.rpartition(".")
    where = f"{entry.file}: tensor '{entry.name}'"
    if target in experts:
        dtypes = SCALE_LOAD_DTYPES if experts[target] == "scale" else (FP8_DTYPE,)
        if entry.torch_dtype not in dtypes or entry.shape != tuple(param.shape):
            raise CheckpointError(f"{where} is {entry.dtype} {list(entry.shape)}, the FP8Experts "
                                  f"layer expects {dtypes[0]} {list(param.shape)}"
                                  + (" (quantize the checkpoint with `fp8linear quantize`)"
                                     if experts[target] == "weight" else ""))
        return
    if owner in fp8 and leaf in ("weight", "weight_scale_inv"):
        mod = fp8[owner]
        if leaf == "weight":
            dtypes, want = (FP8_DTYPE,), [(mod.out_features, mod.in_features)]
        else:
            kb = cdiv(mod.in_features, BLOCK)
            dtypes = SCALE_LOAD_DTYPES
            want = [(cdiv(mod.out_features, BLOCK), kb), (mod.out_features, kb)]
        if entry.torch_dtype not in dtypes:
            raise CheckpointError(f"{where} is {entry.dtype}, the FP8Linear layer '{owner}' "
                                  f"expects {dtypes[0]}"
                                  + (" (or bfloat16/float16)" if len(dtypes) > 1 else ""))
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


def _assign(target, param, t, fp8):
    owner, _, leaf = target.rpartition(".")
    if owner in fp8 and leaf == "weight_scale_inv" and tuple(t.shape) != tuple(param.shape):
        # block <-> per-row scales (tensor-parallel shards not aligned to 128): take the
        # file's layout
        param.data = t.to(device=param.device, dtype=torch.float32).contiguous()
        return
    param.copy_(t)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_index(path: Path, weight_map: dict, total_size: int, other_files=()) -> None:
    """The shard index, with the list of every top-level file fp8linear wrote into ``path``:
    ``fp8linear quantize --force`` replaces a folder only when it holds nothing else."""
    files = sorted({*weight_map.values(), INDEX_NAME, CONFIG_NAME, *other_files})
    _write_json(path / INDEX_NAME, {
        "metadata": {"total_size": total_size,
                     "fp8linear": {"version": __version__, "files": files}},
        "weight_map": weight_map})


def written_files(path: Path) -> Optional[set]:
    """The files ``write_index`` recorded in ``path``, or None if fp8linear did not write it."""
    try:
        files = json.loads((path / INDEX_NAME).read_text())["metadata"]["fp8linear"]["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return set(files) if isinstance(files, list) else None

