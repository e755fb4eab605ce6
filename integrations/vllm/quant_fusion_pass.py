"""A post-grad graph pass: the kernels before our linear layers quantize their own output.

vLLM's RMSNorm -> our linears becomes one norm + quantization kernel -> block-FP8 GEMMs on its
fp8 output, and SiLU-and-mul -> down_proj one activation + quantization kernel -> GEMM.
Without it, a decoder's input and post-attention norms and its MLP activation write bf16 and
every linear after them quantizes that in a kernel of its own (or, at <= 16 tokens, in its
GEMM's prologue): one more grid-dependency hop per GEMM, ~1-2 us at 16-64 tokens on an H100
(docs/tuning.md: vllm-fuse-quant).

What it matches (vLLM 0.24 / 0.32):
- Norms. vLLM's RMSNorm calls the IR ops ``vllm_ir.rms_norm`` and ``vllm_ir.fused_add_rms_norm``
  (a pre-grad pass makes the in-place variant functional), which stay single nodes of the
  post-grad graph until vLLM lowers them, after custom passes. Rewritten when there is no
  variance-size override.
- SiLU-and-mul. vLLM's SiluAndMul is plain torch under compile (``F.silu(x[..., :d]) *
  x[..., d:]``), which the post-grad graph spells as two slices of x, silu (``aten.silu`` or
  its decomposition ``a / (1 + exp(-a))`` in fp32, rounded back) and a multiply; each of these
  spellings is recognised node by node, anything else is left alone.
A producer is rewritten when every user of its output is our ``fp8linear.fp8_linear`` op over
that output, on 2-D bf16/fp16 activations with a multiple of 128 channels. Anything else is
left as it was.

The plugin installs it as Inductor's ``post_grad_custom_post_pass`` (compile_config.py), which
vLLM's pass manager runs with its own passes.
"""
from __future__ import annotations

import logging
import operator

import torch
from torch import fx

import fp8linear.swiglu_quant  # noqa: F401  (registers fp8linear::silu_mul_quant)

from fp8linear.norm_quant import DTYPES
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


class QuantFusionPass(InductorPass):
    """See the module docstring. ``self.rewritten`` counts the producers (norms, SiLU-and-mul)
    rewritten by the last call, ``QuantFusionPass.norms`` and ``.acts`` those of the process
    by kind (logs, tests)."""

    norms = acts = 0

    def __init__(self):
        self.rewritten = 0

    def uuid(self) -> str:
        # the compile cache must change when this file or the fused kernels change (located by
        # module name, without importing Triton, which a CPU vLLM may lack)
        import importlib.util
        from pathlib import Path

        mods = ("fp8linear.norm_quant", "fp8linear.ops", "fp8linear.backends.triton.norm_quant",
                "fp8linear.swiglu_quant", "fp8linear.backends.triton.swiglu_quant")
        return InductorPass.hash_source(
            self, *(Path(importlib.util.find_spec(m).origin).read_text() for m in mods))

    def __call__(self, graph: fx.Graph) -> None:
        rms, add_rms = _ir_op("rms_norm"), _ir_op("fused_add_rms_norm")
        norms = {t for t in (rms, add_rms) if t is not None}   # (none: a vLLM without IR ops)
        norms_done = acts_done = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in norms:
                norms_done += self._norm(graph, node, add_rms)
            elif node.target is _MUL:
                acts_done += self._silu_mul(graph, node)
        self.rewritten = norms_done + acts_done
        if self.rewritten:
            # at info level for a graph with a kind of rewrite this process had not made yet
            # (the engine log then shows each kind once; a line per compiled piece would be
            # dozens), else debug
            new_kind = (norms_done and not QuantFusionPass.norms) or \
                (acts_done and not QuantFusionPass.acts)
            (_log.info if new_kind else _log.debug)(
                "fp8_blockgemm: %d RMSNorm(s) and %d SiLU-and-mul(s) of this graph now "
                "quantize their output for the linear layers after them", norms_done, acts_done)
        QuantFusionPass.norms += norms_done
        QuantFusionPass.acts += acts_done

    # -- RMSNorm (+ residual add) -> linears

    def _norm(self, graph, node, add_rms) -> bool:
        if node.target is add_rms:
            x, res, w, eps, *rest = node.args
            outs = list(node.users)
            if not all(u.target is operator.getitem for u in outs):
                return False
            ys = [u for u in outs if u.args[1] == 0]
            rs = [u for u in outs if u.args[1] == 1]
            if len(ys) != 1:
                return False
            y = ys[0]
        else:
            x, w, eps, *rest = node.args
            res, rs, y = None, [], node
        xv = _val(x)
        if (rest and rest[0] is not None) or node.kwargs or xv is None \
                or not _fits(x, y, xv.shape[-1]):
            return False
        with graph.inserting_before(node), xv.fake_mode:
            if res is not None:
                target = torch.ops.fp8linear.add_rms_norm_quant.default
                args = (x, res, w, eps)
                vals = target(xv, _val(res), _val(w), eps)
            else:
                target = torch.ops.fp8linear.rms_norm_quant.default
                args = (x, w, eps)
                vals = target(xv, _val(w), eps)
            fused = _add(graph, target, args, vals)
            if res is not None:
                new_res = _add(graph, operator.getitem, (fused, 2), vals[2])
                for r in rs:
                    r.replace_all_uses_with(new_res)
            _gemms_on(graph, fused, vals, y, xv.dtype)
        # the norm and its outputs, now unused (only these: vLLM's graph is left as it was)
        for dead in rs + ([y] if y is not node else []) + [node]:
            graph.erase_node(dead)
        return True

    # -- SiLU-and-mul -> linears

    def _silu_mul(self, graph, h) -> bool:
        x = _silu_mul_input(h)
        xv = _val(x)
        if xv is None or _val(h) is None or _val(h).dtype != xv.dtype \
                or not _fits(x, h, xv.shape[-1] // 2):
            return False
        with graph.inserting_before(h), xv.fake_mode:
            target = torch.ops.fp8linear.silu_mul_quant.default
            vals = target(xv)
            fused = _add(graph, target, (x,), vals)
            _gemms_on(graph, fused, vals, h, xv.dtype)
        _erase_dead(graph, h)
        return True


_MUL = torch.ops.aten.mul.Tensor
_CONVERT = torch.ops.prims.convert_element_type.default


def _fits(x, y, channels) -> bool:
    """x: 2-D bf16/fp16 with whole 128-channel groups of ``channels``, y's every user our
    linear over y."""
    xv = _val(x)
    if xv is None or xv.dim() != 2 or xv.dtype not in DTYPES:
        return False
    if not isinstance(channels, int) or channels <= 0 or channels % BLOCK:
        return False
    linear = torch.ops.fp8linear.fp8_linear.default
    users = list(y.users)
    return bool(users) and all(
        u.op == "call_function" and u.target is linear and u.args[0] is y
        and y not in u.args[1:] and not u.kwargs for u in users)


def _add(graph, target, args, val):
    new = graph.call_function(target, args)
    new.meta["val"] = val
    return new


def _gemms_on(graph, fused, vals, y, dtype):
    """Every linear over y becomes block_fp8_gemm_scale_t over the fused op's (fp8, scale_t)."""
    q = _add(graph, operator.getitem, (fused, 0), vals[0])
    scale_t = _add(graph, operator.getitem, (fused, 1), vals[1])
    gemm = torch.ops.fp8linear.block_fp8_gemm_scale_t.default
    for lin in list(y.users):
        _, lw, lws, bias = lin.args
        with graph.inserting_before(lin):
            out = _add(graph, gemm, (q, scale_t, lw, lws, bias, dtype),
                       gemm(vals[0], vals[1], _val(lw), _val(lws), _val(bias), dtype))
        lin.replace_all_uses_with(out)
        graph.erase_node(lin)


def _erase_dead(graph, node):
    """Erase node and then whatever of its inputs' chain only it used (pure ops only)."""
    todo, erased = [node], set()
    while todo:
        n = todo.pop()
        if n in erased or n.op != "call_function" or n.users or n.is_impure():
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        todo.extend(inputs)


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _unconvert(node, dtype=None):
    """The input of a convert_element_type (to dtype, if given), else the node itself."""
    if _is(node, _CONVERT) and (dtype is None or node.args[1] == dtype):
        return node.args[0]
    return node


def _silu_arg(node):
    """a where node computes silu(a), in the spellings torch's post-grad graphs use, else None:
    aten.silu(a); silu's decomposition convert(div(c, add(exp(neg(c)), 1))) and
    mul(c, sigmoid(c)), with c = convert(a, fp32); each possibly wrapped in a convert."""
    t = _unconvert(node)
    if _is(t, torch.ops.aten.silu.default):
        return _unconvert(t.args[0], torch.float32)
    c = None
    if _is(t, torch.ops.aten.div.Tensor):
        c, den = t.args
        if not (_is(den, torch.ops.aten.add.Tensor) and 1 in den.args):
            return None
        e = den.args[0] if den.args[1] == 1 else den.args[1]
        if not (_is(e, torch.ops.aten.exp.default) and _is(e.args[0], torch.ops.aten.neg.default)
                and e.args[0].args[0] is c):
            return None
    elif _is(t, _MUL):
        a, b = t.args
        for c_, sig in ((a, b), (b, a)):
            if _is(sig, torch.ops.aten.sigmoid.default) and sig.args[0] is c_:
                c = c_
    if not isinstance(c, fx.Node):
        return None
    if _val(c) is not None and _val(c).dtype != torch.float32:
        return None
    return _unconvert(c, torch.float32)


def _slice(node):
    """(x, start, end) of a slice of a 2-D x along its last dim with step 1, else None."""
    node = _unconvert(node)
    if not _is(node, torch.ops.aten.slice.Tensor) or node.kwargs:
        return None
    x, dim, start, end, *step = list(node.args) + [None] * (4 - len(node.args))
    xv = _val(x)
    if xv is None or xv.dim() != 2 or dim not in (1, -1) or step not in ([], [1]):
        return None
    return x, start or 0, end


def _silu_mul_input(h):
    """The x of h = silu(x[:, :d]) * x[:, d:] (vLLM's SiluAndMul.forward_native) with x
    [M, 2d] contiguous, else None."""
    if not _is(h, _MUL) or len(h.args) != 2 or h.kwargs:
        return None
    for gate, up in (h.args, h.args[::-1]):
        a = _silu_arg(gate) if isinstance(gate, fx.Node) else None
        lo, hi = _slice(a) if a is not None else None, _slice(up)
        if lo is None or hi is None or lo[0] is not hi[0]:
            continue
        x = lo[0]
        two_d = _val(x).shape[1]
        if not isinstance(two_d, int) or two_d % 2:
            continue
        d = two_d // 2
        end = two_d if hi[2] is None else hi[2]
        if lo[1:] == (0, d) and hi[1] == d and isinstance(end, int) and end >= two_d \
                and _val(x).stride() == (two_d, 1):
            return x
    return None
