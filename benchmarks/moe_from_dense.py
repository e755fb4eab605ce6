"""A mixture-of-experts checkpoint cut from a trained dense one, so that the MoE path's
quality is measured on trained weights (no small trained MoE checkpoint ships in a package).

Each layer's MLP (gate and up [I, H], down [H, I]) is cut along I into G groups of I/G
channels; each group becomes two experts holding the same slice, E = 2G, top-k = G. The
router holds one seeded random direction r: experts 2g and 2g+1 get the logits s_g r.x and
-s_g r.x (s_g = +1, -1 alternating). Each pair has one logit >= 0 and the other <= 0, so
the top G are one expert of every group, all with the logit |r.x|, and the softmax-
renormalized routing weights are exactly 1/G; down is scaled by G (a power of two: exact in
bf16 and in block FP8's scales). So the MoE model computes the dense model's MLP up to the
order of the sums, while its tokens take one of two expert sets by the sign of r.x: uneven
expert loads and distinct weights within a set, on the activations of a trained model.
(A token with r.x == 0 exactly would tie all 2G logits; it does not occur in practice.)

The output is a Mixtral checkpoint (``MixtralForCausalLM``) under the names Mixtral's own
checkpoints use, which transformers and vLLM read: ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down).

  python benchmarks/moe_from_dense.py --dense /work/models/smollm2-135m-bf16 \\
      --out /work/models/smollm2-135m-moe-bf16 [--groups 4] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import common

BLOCK = 128  # the weights' FP8 block: every expert slice stays on its grid
_MLP = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_KEYS_DROPPED = ("mlp_bias", "pretraining_tp")  # Llama-only fields


def _check_dense(cfg: dict, groups: int, src: Path) -> None:
    """What the split needs of the dense model's config (a ValueError naming the field)."""
    if cfg.get("model_type") != "llama" or cfg.get("mlp_bias"):
        raise ValueError(f"{src}/config.json: expected a Llama model without MLP biases "
                         f"(model_type 'llama'), got {cfg.get('model_type')!r}")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers")
               if not isinstance(cfg.get(k), int)]
    if missing:
        raise ValueError(f"{src}/config.json: no integer {', '.join(missing)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{src}/config.json: hidden_act {cfg['hidden_act']!r}, expected 'silu'")
    if groups < 1 or groups & (groups - 1):
        raise ValueError(f"--groups {groups}: expected a power of two (down is scaled by it)")
    inter = cfg["intermediate_size"]
    if inter % (groups * BLOCK):
        raise ValueError(f"{src}/config.json: intermediate_size {inter} does not split into "
                         f"{groups} groups of a multiple of {BLOCK} channels")


def moe_config(cfg: dict, groups: int) -> dict:
    """The Mixtral config of the split model (the dense config's other fields kept)."""
    out = {k: v for k, v in cfg.items() if k not in _KEYS_DROPPED}
    out.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
               intermediate_size=cfg["intermediate_size"] // groups,
               num_local_experts=2 * groups, num_experts_per_tok=groups,
               output_router_logits=False, router_aux_loss_coef=0.0, router_jitter_noise=0.0,
               sliding_window=None)
    return out


def split_layer(gate, up, down, router_dir, groups: int) -> dict:
    """One MLP's experts and router, by the names under ``block_sparse_moe.``."""
    import torch
    inter = gate.shape[0] // groups
    out = {}
    for g in range(groups):
        rows = slice(g * inter, (g + 1) * inter)
        for e in (2 * g, 2 * g + 1):
            # (copies: safetensors stores no tensor twice)
            out[f"experts.{e}.w1.weight"] = gate[rows].clone()
            out[f"experts.{e}.w3.weight"] = up[rows].clone()
            out[f"experts.{e}.w2.weight"] = (down[:, rows] * groups).contiguous()
    signs = torch.tensor([(1, -1)[g % 2] for g in range(groups)], dtype=torch.float32)
    rows = torch.stack([signs[:, None] * router_dir, -signs[:, None] * router_dir], dim=1)
    out["gate.weight"] = rows.reshape(2 * groups, -1).to(gate.dtype)  # [2G, H]
    return out


def split_checkpoint(dense: str, out: str, groups: int = 4, seed: int = 0,
                     force: bool = False) -> Path:
    """Writes the split model's checkpoint folder ``out`` (config.json, model.safetensors,
    the dense folder's tokenizer and generation files, SOURCE.txt). Validates everything
    before writing; the folder appears whole or not at all."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(dense).resolve(), Path(out)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: no such file (a dense checkpoint folder)")
    cfg = json.loads(cfg_path.read_text())
    _check_dense(cfg, groups, src)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no *.safetensors file")
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists (pass --force to replace it)")

    gen = torch.Generator().manual_seed(seed)
    hidden = cfg["hidden_size"]
    state, mlp = {}, {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                m = _MLP.match(name)
                if m:
                    mlp.setdefault(m.group(1), {})[m.group(2)] = sf.get_tensor(name)
                else:
                    state[name] = sf.get_tensor(name)
    if len(mlp) != cfg["num_hidden_layers"] or any(len(v) != 3 for v in mlp.values()):
        raise ValueError(f"{src}: expected gate_proj, up_proj and down_proj in each of "
                         f"{cfg['num_hidden_layers']} layers, found {len(mlp)} layers' MLPs")
    for prefix in sorted(mlp, key=lambda p: int(p.rsplit(".", 1)[1])):
        w = mlp[prefix]
        router_dir = torch.randn(hidden, generator=gen) / hidden ** 0.5
        for k, v in split_layer(w["gate_proj"], w["up_proj"], w["down_proj"], router_dir,
                                groups).items():
            state[f"{prefix}.block_sparse_moe.{k}"] = v

    with common.new_folder(out) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(
            json.dumps(moe_config(cfg, groups), indent=2, sort_keys=True) + "\n")
        for p in src.iterdir():
            if p.is_file() and p.suffix != ".safetensors" and p.name not in (
                    "config.json", "SOURCE.txt", "model.safetensors.index.json"):
                shutil.copy2(p, tmp / p.name)
        dense_source = (src / "SOURCE.txt").read_text().strip() if (
            src / "SOURCE.txt").exists() else "(no SOURCE.txt)"
        (tmp / "SOURCE.txt").write_text(
            f"{src.name}, its MLPs split into {2 * groups} experts, top-{groups} "
            f"(benchmarks/moe_from_dense.py, seed {seed})\n"
            f"Each expert pair holds 1/{groups} of a layer's MLP channels; the router picks "
            "one of each pair with equal weights, so the model computes the dense model's "
            f"MLP.\nThe dense checkpoint: {dense_source}\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moe_from_dense.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dense", required=True, help="a Llama BF16 safetensors checkpoint folder")
    p.add_argument("--out", required=True, help="the Mixtral checkpoint folder to write")
    p.add_argument("--groups", type=int, default=4,
                   help="G: 2G experts, top-G, intermediate / G channels each (default 4)")
    p.add_argument("--seed", type=int, default=0, help="the routers' random directions")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    a = p.parse_args(argv)
    try:
        print(split_checkpoint(a.dense, a.out, a.groups, a.seed, a.force))
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"moe_from_dense.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
