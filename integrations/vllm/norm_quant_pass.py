"""A post-grad graph pass: vLLM's RMSNorm -> our linears becomes one norm + quantization kernel
-> block-FP8 GEMMs on its fp8 output.

Without it, a decoder's input and post-attention norms write bf16 and every linear after them
quantizes that in a kernel of its own (or, at <= 16 tokens, in its GEMM's prologue): one more
grid-dependency hop per GEMM, ~1-2 us at 16-64 tokens on an H100 (benchmarks/NOTES.md,
session 15; fusing it measured 0.96-0.98x the time of a Llama 8B layer at 16-64 tokens).

What it matches (vLLM 0.24 / 0.32): vLLM's RMSNorm calls the IR ops ``vllm_ir.rms_norm`` and
``vllm_ir.fused_add_rms_norm`` (a pre-grad pass makes the in-place variant functional), which
stay single nodes of the post-grad graph until vLLM lowers them, after custom passes. A norm
node is rewritten when every user of its normalised output is our ``fp8linear.fp8_linear``
op over that output, on 2-D bf16/fp16 activations with a multiple of 128 channels and no
variance-size override. Anything else is left as it was.

The plugin installs it as Inductor's ``post_grad_custom_post_pass`` (compile_config.py), which
vLLM's pass manager runs with its own passes.
"""
from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from fp8linear.norm_quant import _DTYPES
from fp8linear.quant import BLOCK

_log = logging.getLogger("vllm.fp8_blockgemm")  # (vLLM's logging configuration applies)

try:  # vLLM's base class: its pass manager takes only InductorPass instances
    from vllm.compilation.passes.inductor_pass import InductorPass
except ImportError:  # pragma: no cover - vLLM builds without it run no passes of ours
    InductorPass = object


def _ir_op(name: str):
    ns = getattr(torch.ops, "vllm_ir", None)
    packet = getattr(ns, name, None) if ns is not None else None
    return getattr(packet, "default", None) if packet is not None else None


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


class NormQuantPass(InductorPass):
    """See the module docstring. ``self.rewritten`` counts the norms rewritten by the last
    call, ``NormQuantPass.total`` those of the process (logs, tests)."""

    total = 0

    def __init__(self):
        self.rewritten = 0

    def uuid(self) -> str:
        # the compile cache must change when this file or the fused kernel changes
        from pathlib import Path

        import fp8linear
        root = Path(fp8linear.__file__).parent
        return InductorPass.hash_source(
            self, *((root / f).read_text() for f in ("norm_quant.py", "ops.py",
                                                     "kernels/triton_norm_quant.py")))

    def __call__(self, graph: fx.Graph) -> None:
        self.rewritten = 0
        rms, add_rms = _ir_op("rms_norm"), _ir_op("fused_add_rms_norm")
        norms = {t for t in (rms, add_rms) if t is not None}   # (none: a vLLM without IR ops)
        linear = torch.ops.fp8linear.fp8_linear.default
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in norms:
                continue
            if node.target is add_rms:
                x, res, w, eps, *rest = node.args
                outs = list(node.users)
                if not all(u.target is operator.getitem for u in outs):
                    continue
                ys = [u for u in outs if u.args[1] == 0]
                rs = [u for u in outs if u.args[1] == 1]
                if len(ys) != 1:
                    continue
                y = ys[0]
            else:
                x, w, eps, *rest = node.args
                res, rs, y = None, [], node
            if (rest and rest[0] is not None) or node.kwargs or not self._fits(x, y, linear):
                continue
            self._rewrite(graph, node, x, res, w, eps, y, rs)
            self.rewritten += 1
        if self.rewritten:
            # once at info level (one line a compiled piece would be dozens), then debug
            (_log.info if NormQuantPass.total == 0 else _log.debug)(
                "fp8_blockgemm: %d RMSNorm(s) of this graph now quantize their output for "
                "the linear layers after them", self.rewritten)
        NormQuantPass.total += self.rewritten

    @staticmethod
    def _fits(x, y, linear) -> bool:
        xv = _val(x)
        if xv is None or xv.dim() != 2 or xv.dtype not in _DTYPES:
            return False
        k = xv.shape[-1]
        if not isinstance(k, int) or k % BLOCK:
            return False
        users = list(y.users)
        return bool(users) and all(
            u.op == "call_function" and u.target is linear and u.args[0] is y
            and y not in u.args[1:] and not u.kwargs for u in users)

    @staticmethod
    def _rewrite(graph, node, x, res, w, eps, y, rs):
        fake_mode = _val(x).fake_mode

        def add(target, args, val):
            new = graph.call_function(target, args)
            new.meta["val"] = val
            return new

        with graph.inserting_before(node), fake_mode:
            xv, wv = _val(x), _val(w)
            if res is not None:
                target = torch.ops.fp8linear.add_rms_norm_quant.default
                args = (x, res, w, eps)
                vals = target(xv, _val(res), wv, eps)
            else:
                target = torch.ops.fp8linear.rms_norm_quant.default
                args = (x, w, eps)
                vals = target(xv, wv, eps)
            fused = add(target, args, vals)
            q = add(operator.getitem, (fused, 0), vals[0])
            scale_t = add(operator.getitem, (fused, 1), vals[1])
            if res is not None:
                new_res = add(operator.getitem, (fused, 2), vals[2])
                for r in rs:
                    r.replace_all_uses_with(new_res)
            gemm = torch.ops.fp8linear.block_fp8_gemm_scale_t.default
            for lin in list(y.users):
                _, lw, lws, bias = lin.args
                with graph.inserting_before(lin):
                    out = add(gemm, (q, scale_t, lw, lws, bias, xv.dtype),
                              gemm(vals[0], vals[1], _val(lw), _val(lws), _val(bias), xv.dtype))
                lin.replace_all_uses_with(out)
                graph.erase_node(lin)
        # the norm and its outputs, now unused (only these: vLLM's graph is left as it was)
        for dead in rs + ([y] if y is not node else []) + [node]:
            graph.erase_node(dead)
