#!/usr/bin/env python3
"""Block-FP8 GEMM benchmark: fp8linear against DeepGEMM, cuBLASLt blockwise, vLLM's Triton
kernel and bf16 F.linear, timed side by side in one run (issues 3 and 4).

Method (issue 3, "Performance"):
- per shape, R copies of the weights whose bytes together exceed --min-mb (420 MB: the 50 MB
  L2 never holds them); every method times one CUDA graph holding L launches that cycle
  through the copies (L a whole number of cycles, sized so that a replay lasts >= ~300 us);
  time per GEMM = replay time / L;
- >= 20 timed replays per method and point (after 3 warm-up replays), one replay of each
  method in turn, the order rotating each round; the median is reported;
- the whole sweep (all shapes and M) runs --repeats times (>= 2); `us` is the median over the
  replays of all repeats, `us_reps` the per-repeat medians (their spread is the noise);
- the read bandwidth for the floor comes from a read-only reduction over 2 GiB in the same run;
- random data everywhere (never zeros); each method's output is checked once per point
  against an fp32 reference of the dequantized inputs (`rel_err`).

What each method times is the call as its own dispatcher runs it:
- fp8linear: fp8linear.block_fp8_gemm(a_fp8, a_scale, w, w_scale) with pre-quantized
  activations, the same tensors DeepGEMM gets (a_scale [M, K/128] M-major with strides
  (1, ld), ld = M rounded up to 4: the layout our quant kernel writes inside fp8_linear, and
  vLLM's), output allocated by the op, any scale re-layout the backend does included (until
  2026-11-23 this method got row-major scales and timed a transposing copy with them);
- fp8linear_linear: fp8linear.fp8_linear(x_bf16, w, w_scale): activation quant included;
- fp8linear_triton: fp8linear.block_fp8_gemm with FP8LINEAR_BACKEND=triton;
- deepgemm: vLLM's DeepGemmFp8BlockScaledMMKernel.apply_block_scaled_mm: torch.empty output +
  deep_gemm.fp8_gemm_nt((a, a_scale), (w, w_scale), out, disable_ue8m0_cast=False), with
  a_scale already MN-major and TMA-aligned (vLLM's quant kernel writes it so:
  VLLM_USE_DEEP_GEMM_TMA_ALIGNED_SCALES=1, column_major_scales=True), weight scales the fp32
  [N/128, K/128] tensor (on sm90 DeepGEMM uses it as is), PDL on as vLLM sets it;
- cublaslt_blockwise: torch._scaled_mm (or F.scaled_mm) with 1x128 activation and 128x128
  weight scales; M padded to a multiple of 4 and a_scale M-major, as a quant kernel would
  write them;
- vllm_triton: vLLM's w8a8_triton_block_scaled_mm (its tuned H100 configs): from an installed
  vLLM, else the verbatim copy scripts/prepare_deepgemm.sh extracts from the vLLM wheel
  into .deepgemm/vllm_w8a8 (no vLLM install needed on the device);
- bf16: F.linear(x_bf16, w_bf16) with its own > 420 MB of bf16 weight copies.
The fp8 methods share the same fp8 weights (block scales not rounded to powers of two: on
sm90 DeepGEMM runs the same kernel for fp32 scales either way, and speed does not depend on
the scale values).

--decode (issue 4): M in 1..256, each point timed back to back ("b2b") and with an
RMSNorm-sized kernel before every GEMM inside the graph, by default an elementwise [M, K] bf16
multiply ("elem"); --neighbours adds a Triton RMSNorm without PDL ("norm") and with PDL as
torch Inductor generates it ("norm_pdl", benchmarks/neighbour.py). Those rows report the
GEMM's share (graph time minus a neighbour-only graph, per launch) in `us`, with `us_gross`
and `us_elem` beside it.

JIT: DeepGEMM compiles one kernel per (N, K, tile config) with nvcc on first use, Triton one
per specialisation. Before timing, worker processes warm every point in parallel (the JIT
caches are on disk and shared); the wall time goes to the header (`jit`), never into `us`.

Run from the repository root, e.g.
  python benchmarks/bench_gemm.py --quick
  python benchmarks/bench_gemm.py --shapes ds --out benchmarks/results/gemm_ds.json
  python benchmarks/bench_gemm.py --decode --shapes llama70b
  python benchmarks/plot.py benchmarks/results/gemm_*.json --table   # merge the parts
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import common as C  # noqa: E402  (benchmarks/common.py, beside this script)

T_START = time.time()
DEV = "cuda"   # "cpu" only for --cpu-dry-run (the plumbing, with the torch reference backend)


def sync():
    if DEV == "cuda":
        import torch
        torch.cuda.synchronize()


def empty_cache():
    if DEV == "cuda":
        import torch
        torch.cuda.empty_cache()


def log(*a):
    print(f"[{time.time() - T_START:7.1f}s]", *a, flush=True)


# ------------------------------------------------------------------------------ CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help="all | quick | ds | llama8b | llama70b | indices into the issue's list "
                        "| NxK, comma-separated (default: all; --quick: quick)")
    p.add_argument("--m", default=None,
                   help="all | decode | large | quick | A-B | integers, comma-separated "
                        "(default: all; --quick: quick; --decode: decode)")
    p.add_argument("--methods", default="all", help=f"comma list of {', '.join(C.ALL_METHODS)}")
    p.add_argument("--repeats", type=int, default=2, help="whole-sweep repetitions (>= 2)")
    p.add_argument("--replays", type=int, default=20, help="timed replays per point and method")
    p.add_argument("--warmup-replays", type=int, default=3)
    p.add_argument("--sustained", type=float, default=0.0, metavar="S",
                   help="also replay each method's graph alone for S seconds per point and repeat "
                        "(back to back only, CUDA only), with nvidia-smi clock and power: at the "
                        "power cap a method run alone pays its own power draw in clock, which "
                        "the interleaved replays share (rows: us_sustained, "
                        "sustained_speedup_vs_<anchor>, clock_mhz_sustained, power_w_sustained)")
    p.add_argument("--quick", action="store_true",
                   help=f"shapes {C.QUICK_SHAPES}, M {C.QUICK_M} unless given")
    p.add_argument("--decode", action="store_true",
                   help="issue 4's decode mode: M 1..256, back to back and with an "
                        "elementwise kernel between GEMMs")
    p.add_argument("--neighbours", default="elem",
                   help="--decode: the kernels timed before each GEMM besides back to back, "
                        "comma list of neighbour.KINDS (elem, norm, norm_pdl; default elem)")
    p.add_argument("--min-mb", type=float, default=420.0,
                   help="weight copies per method total more than this many MB (> L2)")
    p.add_argument("--out", default=None, help="JSON path (PNGs are written beside it)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip the per-point correctness check")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no new (repeat, shape) after this many seconds (0: no limit); "
                        "the JSON is rewritten after every shape, so a cut run keeps its data")
    p.add_argument("--bw-gib", type=float, default=2.0, help="buffer of the bandwidth reduction")
    p.add_argument("--warm-workers", type=int, default=None,
                   help="parallel JIT warm-up processes (default: CPUs - 2, at most 14; 0: none)")
    p.add_argument("--warm-timeout", type=float, default=360.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.repeats < 1 or a.replays < 1:
        p.error("--repeats and --replays must be >= 1")
    return a


# ------------------------------------------------------------------------- method setup
@contextlib.contextmanager
def env(name, value):
    from fp8linear import knobs
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    knobs.reload()  # fp8linear reads its knobs once per process otherwise
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
        knobs.reload()


def method_env(method):
    return env("FP8LINEAR_BACKEND", "triton") if method == "fp8linear_triton" \
        else contextlib.nullcontext()


class Libs:
    """What each method needs, imported once; `dropped` says why a method is out."""

    def __init__(self, methods, probe_cublas=True):
        import torch
        self.torch = torch
        self.dropped: dict[str, str] = {}
        self.versions: dict[str, str] = {}
        self.dg = None
        self.vllm_mm = None
        self.cublas_variant = None
        self.cublas_probe: list[str] = []
        want = set(methods)
        if want & {"fp8linear", "fp8linear_linear", "fp8linear_triton"}:
            import fp8linear  # noqa: F401
            self.versions["fp8linear"] = getattr(fp8linear, "__version__", "?")
        if "fp8linear_triton" in want:
            try:
                importlib.import_module("fp8linear.backends.triton.gemm")
            except Exception as e:
                self.dropped["fp8linear_triton"] = f"triton backend not importable: {e!r}"
        if "deepgemm" in want:
            self._load_deepgemm()
        if "vllm_triton" in want and DEV != "cuda":
            self.dropped["vllm_triton"] = "needs CUDA"
        elif "vllm_triton" in want:
            try:
                from vllm.model_executor.layers.quantization.utils.fp8_utils import \
                    w8a8_triton_block_scaled_mm
                import vllm
                self.vllm_mm = w8a8_triton_block_scaled_mm
                self.versions["vllm_triton"] = f"vllm {vllm.__version__} (installed)"
            except Exception as e:
                why = f"vllm not importable ({type(e).__name__}: {e})"
                try:
                    self.vllm_mm, self.versions["vllm_triton"] = load_extracted_vllm_triton()
                except Exception as e2:
                    self.dropped["vllm_triton"] = \
                        f"{why}; no extracted copy ({type(e2).__name__}: {e2})"
        if "cublaslt_blockwise" in want and DEV != "cuda":
            self.dropped["cublaslt_blockwise"] = "needs CUDA"
        elif "cublaslt_blockwise" in want and probe_cublas:
            self._probe_cublas()
        try:
            import triton
            self.versions["triton"] = triton.__version__
        except Exception:
            pass

    def _load_deepgemm(self):
        torch = self.torch
        if DEV != "cuda" or torch.cuda.get_device_capability()[0] not in (9, 10):
            self.dropped["deepgemm"] = "DeepGEMM runs on sm90/sm100 only"
            return
        errs = []
        for name in ("deep_gemm", "vllm.third_party.deep_gemm"):
            try:
                dg = importlib.import_module(name)
                break
            except Exception as e:
                errs.append(f"{name}: {type(e).__name__}: {e}")
        else:
            self.dropped["deepgemm"] = "not importable (" + "; ".join(errs) + \
                "): run scripts/prepare_deepgemm.sh and carry .deepgemm"
            return
        if not hasattr(dg, "fp8_gemm_nt"):
            self.dropped["deepgemm"] = f"{dg.__name__} has no fp8_gemm_nt"
            return
        # vLLM turns PDL on for DeepGEMM on sm90+ (vllm.utils.deep_gemm._lazy_init)
        if hasattr(dg, "set_pdl"):
            dg.set_pdl(True)
        self.dg = dg
        self.versions["deep_gemm"] = f"{getattr(dg, '__version__', '?')} ({dg.__name__}, " \
                                     f"{os.path.dirname(dg.__file__)})"

    def _probe_cublas(self):
        """Find how this torch exposes blockwise-scaled cuBLASLt and check it computes the
        right thing (M padded to 4, so M=1 probes the smallest real case)."""
        for m in (1, 37):
            sd = ShapeData(256, 512, copies=1, bf16_copies=0, seed=123)
            md = MData(sd, m, self, seed=m)
            ref = reference(sd, md)
            for variant in ([self.cublas_variant] if self.cublas_variant else ["v1", "v2"]):
                try:
                    out = cublas_call(variant, md.a_p, md.as_pm, sd.wq[0], sd.ws[0])[:m]
                    sync()
                    err = rel_err(out, ref)
                    self.cublas_probe.append(f"{variant} M={m}: rel_err {err:.2e}")
                    if err <= 2e-3:
                        self.cublas_variant = variant
                        break
                    self.cublas_variant = None
                except Exception as e:
                    self.cublas_probe.append(f"{variant} M={m}: {type(e).__name__}: "
                                             f"{str(e).splitlines()[0][:300]}")
            if self.cublas_variant is None:
                self.dropped["cublaslt_blockwise"] = "; ".join(self.cublas_probe)
                return


def load_extracted_vllm_triton(d=None):
    """vLLM's w8a8_triton_block_scaled_mm from the copy scripts/prepare_deepgemm.sh extracted
    (verbatim) out of the vLLM wheel into .deepgemm/vllm_w8a8, run with shims for the vLLM
    objects it touches (logger, current_platform; on CUDA its e8m0 branch never runs). Its
    config lookup finds vLLM's tuned H100 configs beside it, as in vLLM."""
    import functools
    import typing
    import torch
    import triton
    import triton.language as tl
    d = d or os.environ.get("FP8L_VLLM_W8A8_DIR") or os.path.join(ROOT, ".deepgemm", "vllm_w8a8")
    path = os.path.join(d, "fp8_utils.py")
    with open(path) as f:
        src = f.read()

    class _Platform:
        @staticmethod
        def get_device_name():
            return torch.cuda.get_device_name(torch.cuda.current_device())

        @staticmethod
        def is_rocm():
            return False

        @staticmethod
        def is_xpu():
            return False

    class _Logger:
        def info(self, *a, **k):
            pass

        def warning(self, msg, *a, **k):
            log("vllm_triton: " + (msg % a if a else msg))

    def _no_e8m0(t):
        raise RuntimeError("e8m0 scales are not used by this benchmark")

    ns = {"__name__": "vllm_w8a8_extracted", "__file__": path, "torch": torch,
          "triton": triton, "tl": tl, "os": os, "json": json, "functools": functools,
          "Any": typing.Any, "current_platform": _Platform(), "logger": _Logger(),
          "_upcast_e8m0_to_fp32": _no_e8m0}
    exec(compile(src, path, "exec"), ns)
    head = src.splitlines()[0]
    ver = head.split("from ")[1].split(" (")[0] if "from " in head else "?"
    return ns["w8a8_triton_block_scaled_mm"], f"{ver} kernel extracted to {d}"


def cublas_call(variant, a_p, as_pm, w, ws):
    import torch
    if variant == "v1":
        # _scaled_mm infers BlockWise1x128 x BlockWise128x128 from the scale shapes/strides:
        # scale_a [Mp, Kb] strides (1, Mp); scale_b = w_scale.t(): [Kb, Nb] with
        # scale_b.t() row-major.
        return torch._scaled_mm(a_p, w.t(), scale_a=as_pm, scale_b=ws.t(),
                                out_dtype=torch.bfloat16)
    import torch.nn.functional as F
    # v2: scale_b [round_up(Kb, 4), Nb], strides (1, round_up(Kb, 4))
    kb = ws.shape[1]
    kb4 = -(-kb // 4) * 4
    wsb = ws if kb4 == kb else torch.nn.functional.pad(ws, (0, kb4 - kb), value=1.0)
    return F.scaled_mm(a_p, w.t(), as_pm, F.ScalingType.BlockWise1x128, wsb.t(),
                       F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


# ---------------------------------------------------------------------------- data
class ShapeData:
    """R fp8 weight copies (block scales) and Rb bf16 copies of one (N, K), random."""

    def __init__(self, n, k, copies, bf16_copies, seed):
        import torch
        import fp8linear
        self.n, self.k = n, k
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.wq, self.ws = [], []
        for _ in range(copies):
            w = torch.randn(n, k, device=DEV, generator=g) * 0.02
            # some spread between blocks, so block scales differ
            w *= torch.exp(0.5 * torch.randn(n, 1, device=DEV, generator=g))
            q, s = fp8linear.quantize_weight(w)
            del w
            self.wq.append(q)
            self.ws.append(s)
        self.wbf = [(torch.randn(n, k, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
                    for _ in range(bf16_copies)]
        self.w_deq = None  # fp32 dequantized copy 0, built for the checks

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.wq + self.ws + self.wbf) + \
            (self.w_deq.numel() * 4 if self.w_deq is not None else 0)

    def deq(self):
        if self.w_deq is None:
            import fp8linear
            self.w_deq = fp8linear.dequantize_weight(self.wq[0], self.ws[0])
        return self.w_deq


class MData:
    """Activations of one point in every layout the methods take."""

    def __init__(self, sd, m, libs, seed):
        import torch
        import fp8linear
        k = sd.k
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.m = m
        self.x = (torch.randn(m, k, device=DEV, generator=g)
                  * torch.exp(0.5 * torch.randn(m, 1, device=DEV, generator=g))
                  ).to(torch.bfloat16)
        self.a, self.as_ = fp8linear.quantize_activation(self.x)
        kb = self.as_.shape[1]
        # DeepGEMM: M-major scales (DeepGEMM checks the strides and uses them as they are:
        # get_mn_major_tma_aligned_tensor would return them unchanged; calling that helper
        # here would only JIT a transpose.)
        self.as_dg = C.m_major_scales(self.as_, m)
        # cuBLASLt: M padded to a multiple of 4; padded rows zero (scale 1)
        mp = -(-m // 4) * 4
        self.a_p = torch.zeros(mp, k, dtype=self.a.dtype, device=DEV)
        self.a_p[:m] = self.a
        sbuf = torch.ones(kb, mp, dtype=torch.float32, device=DEV)
        sbuf[:, :m].copy_(self.as_.t())
        self.as_pm = sbuf.t()                   # [Mp, Kb], strides (1, Mp)
        # the kernel before each GEMM in the decode modes other than b2b (neighbour.py): an
        # RMSNorm-sized op on [M, K] bf16
        self.e_in = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
        self.e_gamma = torch.randn(k, device=DEV, generator=g).to(torch.bfloat16)
        self.e_out = torch.empty_like(self.e_in)
        self._neighbours = {}

    def neighbour(self, kind):
        """between(i) for C.capture_graph: the neighbour kernel `kind` (neighbour.KINDS)."""
        if kind not in self._neighbours:
            import neighbour
            run = neighbour.make(kind, self.e_in, self.e_gamma, self.e_out)
            self._neighbours[kind] = lambda i=0: run()
        return self._neighbours[kind]


def reference(sd, md):
    """fp32 reference from the dequantized inputs of weight copy 0 (TF32 off)."""
    import fp8linear
    a = fp8linear.dequantize_activation(md.a, md.as_)
    return a @ sd.deq().t()


def rel_err(out, ref):
    import torch
    o = out.float()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - ref).norm() / ref.norm().clamp_min(1e-30))


def supports(method, n, k, m, libs):
    """(ok, reason) for one point."""
    if method in libs.dropped:
        return False, libs.dropped[method]
    if method == "deepgemm" and (n % 64 or k % 128):
        # vLLM routes only these shapes to DeepGEMM (should_use_deepgemm_for_fp8_linear)
        return False, "vLLM uses DeepGEMM only for N % 64 == 0 and K % 128 == 0"
    if method == "cublaslt_blockwise" and (n % 16 or k % 16):
        return False, "_scaled_mm needs N and K multiples of 16"
    return True, ""


def make_launch(method, sd, md, libs):
    """launch(i) runs one GEMM of `method` on weight copy i % R and returns its output."""
    import torch
    import torch.nn.functional as F
    wq, ws, wbf = sd.wq, sd.ws, sd.wbf
    r = len(wq)
    if method in ("fp8linear", "fp8linear_triton"):
        from fp8linear import block_fp8_gemm
        a, s = md.a, md.as_dg
        return lambda i: block_fp8_gemm(a, s, wq[i % r], ws[i % r])
    if method == "fp8linear_linear":
        from fp8linear import fp8_linear
        x = md.x
        return lambda i: fp8_linear(x, wq[i % r], ws[i % r])
    if method == "deepgemm":
        dg, a, s, m, n = libs.dg, md.a, md.as_dg, md.m, sd.n

        def dg_launch(i):
            out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
            dg.fp8_gemm_nt((a, s), (wq[i % r], ws[i % r]), out, disable_ue8m0_cast=False)
            return out
        return dg_launch
    if method == "cublaslt_blockwise":
        v, a, s = libs.cublas_variant, md.a_p, md.as_pm
        return lambda i: cublas_call(v, a, s, wq[i % r], ws[i % r])
    if method == "vllm_triton":
        mm, a, s = libs.vllm_mm, md.a, md.as_
        return lambda i: mm(a, wq[i % r], s, ws[i % r], [128, 128], torch.bfloat16)
    if method == "bf16":
        rb, x = len(wbf), md.x
        return lambda i: F.linear(x, wbf[i % rb])
    raise ValueError(method)


def backend_name(method, m, n, k):
    if not method.startswith("fp8linear"):
        return None
    import torch
    from fp8linear.backends import dispatch
    with method_env(method):
        try:
            mod = dispatch.backend_for(torch.device(DEV), m, n, k)
        except Exception as e:
            return f"error: {e}"
    name = getattr(mod, "name", mod.__name__)
    if name == "sm90" and DEV == "cuda":
        from fp8linear.backends.sm90 import plan as sm90_plan
        try:
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            # (fp8_linear's GEMM runs behind the quant kernel: its plan knows)
            plan = sm90_plan.choose(m, n, k, sms, after_quant=method == "fp8linear_linear")
            return f"sm90 {plan}"
        except Exception:
            pass
    return name


# ---------------------------------------------------------------------- JIT warm-up
JIT_METHODS = ("deepgemm", "vllm_triton", "fp8linear_triton", "fp8linear", "fp8linear_linear")


def warm_worker(spec: str) -> int:
    """Child process: first call of every (method, N, K, M) given, so the JIT caches on disk
    (DeepGEMM's DG_JIT_CACHE_DIR, Triton's) hold every kernel before the timed run."""
    job = json.loads(spec)
    libs = Libs(job["methods"], probe_cublas=False)
    cur = None
    for n, k, m in job["items"]:
        if cur is None or (cur.n, cur.k) != (n, k):
            cur = None
            empty_cache()
            cur = ShapeData(n, k, copies=1, bf16_copies=0, seed=n * 7 + k)
        md = MData(cur, m, libs, seed=m)
        for meth in job["methods"]:
            ok, _ = supports(meth, n, k, m, libs)
            if not ok:
                continue
            t = time.time()
            try:
                with method_env(meth):
                    make_launch(meth, cur, md, libs)(0)
                sync()
                res = {"method": meth, "N": n, "K": k, "M": m, "s": time.time() - t}
            except Exception as e:
                res = {"method": meth, "N": n, "K": k, "M": m, "s": time.time() - t,
                       "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print("WARM " + json.dumps(res), flush=True)
    return 0


def dg_cache_count():
    d = os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".deep_gemm")
    try:
        return len([e for e in os.listdir(os.path.join(d, "cache")) if e.startswith("kernel.")])
    except OSError:
        return None


def parallel_warmup(points, methods, libs, workers, timeout):
    """points: [(n, k, m)]; runs `workers` child processes over contiguous chunks (neighbouring
    M of one shape tend to share a kernel, so a chunk rarely compiles what another does)."""
    meths = [m for m in methods if m in JIT_METHODS and m not in libs.dropped
             and m not in ("fp8linear", "fp8linear_linear")]
    # fp8linear's sm90 path has no per-shape JIT; its Triton fallbacks are warmed by the
    # timed run's first call.
    info = {"methods": meths, "workers": 0, "wall_s": 0.0, "items": 0, "errors": [],
            "dg_kernels_before": dg_cache_count()}
    if not meths or not points or workers <= 0:
        return info
    workers = min(workers, len(points))
    chunks = [points[i * len(points) // workers:(i + 1) * len(points) // workers]
              for i in range(workers)]
    t0 = time.time()
    procs = []
    # each worker writes to its own file: a pipe nobody reads yet would stall a chatty one
    tmpdir = tempfile.mkdtemp(prefix="bench_warm_")
    for i, ch in enumerate(chunks):
        spec = json.dumps({"methods": meths, "items": ch})
        fout = open(os.path.join(tmpdir, f"w{i}.log"), "w+")
        procs.append((subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                        "--warm-worker", spec], stdout=fout,
                                       stderr=subprocess.STDOUT, text=True), fout))
    results = []
    for p, fout in procs:
        left = max(1.0, timeout - (time.time() - t0))
        try:
            p.wait(timeout=left)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            info["errors"].append(f"worker {p.pid} killed after {timeout:.0f}s")
        fout.seek(0)
        out = fout.read()
        fout.close()
        for line in out.splitlines():
            if line.startswith("WARM "):
                results.append(json.loads(line[5:]))
        if p.returncode not in (0, None, -9):
            info["errors"].append(f"worker {p.pid} exit {p.returncode}: "
                                  + " | ".join(out.splitlines()[-5:]))
    shutil.rmtree(tmpdir, ignore_errors=True)
    info.update(workers=workers, wall_s=time.time() - t0, items=len(results),
                dg_kernels_after=dg_cache_count())
    for meth in meths:
        rs = [r for r in results if r["method"] == meth]
        if rs:
            info[f"{meth}_first_call_s_sum"] = sum(r["s"] for r in rs)
            info[f"{meth}_first_call_s_max"] = max(r["s"] for r in rs)
    info["errors"] += [f"{r['method']} {r['N']}x{r['K']} M={r['M']}: {r['error']}"
                       for r in results if "error" in r]
    return info


# ----------------------------------------------------------------------------- sweep
class Sweep:
    def __init__(self, args, libs, methods, shapes, ms, modes, bw):
        import torch
        self.torch = torch
        self.args, self.libs, self.methods = args, libs, methods
        self.shapes, self.ms, self.modes, self.bw = shapes, ms, modes, bw
        self.samples: dict[tuple, list[list[float]]] = {}   # key -> per-repeat sample lists
        self.extra: dict[tuple, dict] = {}
        self.point_errors: list[str] = []
        self.cache: dict[tuple, ShapeData] = {}
        self.sampler = (C.ClockSampler() if args.sustained > 0 and DEV == "cuda" else None)

    def shape_data(self, n, k):
        key = (n, k)
        if key in self.cache:
            return self.cache[key]
        min_total = self.args.min_mb * 1e6
        r = C.copies_for(C.fp8_weight_bytes(n, k), min_total)
        rb = C.copies_for(2 * n * k, min_total) if "bf16" in self.methods else 0
        t = time.time()
        sd = ShapeData(n, k, r, rb, seed=self.args.seed * 1000003 + n * 31 + k)
        sync()
        log(f"  weights {n}x{k}: {r} fp8 copies, {rb} bf16 copies "
            f"({sd.nbytes() / 1e9:.2f} GB, {time.time() - t:.1f}s)")
        # keep weight sets across repeats while they fit the budget
        used = sum(s.nbytes() for s in self.cache.values())
        if used + sd.nbytes() <= 30e9:
            self.cache[key] = sd
        return sd

    def run_point(self, rep, sd, m):
        args = self.args
        n, k = sd.n, sd.k
        md = MData(sd, m, self.libs, seed=args.seed * 7919 + rep * 104729 + m)
        check = rep == 0 and not args.no_check
        ref = reference(sd, md) if check else None
        est = C.est_us(m, n, k)
        for mode in self.modes:
            graphs, launches = {}, {}
            for meth in self.methods:
                ok, why = supports(meth, n, k, m, self.libs)
                if not ok:
                    continue
                key = (meth, n, k, m, mode)
                copies = len(sd.wbf) if meth == "bf16" else len(sd.wq)
                L = C.launches_for(copies, est * (2 if meth == "bf16" else 1))
                try:
                    launch = make_launch(meth, sd, md, self.libs)
                    with method_env(meth):
                        t = time.time()
                        out = launch(0)
                        sync()
                        first = time.time() - t
                        ex = self.extra.setdefault(key, {})
                        if rep == 0:
                            ex["first_call_ms"] = first * 1e3
                            ex["backend"] = backend_name(meth, m, n, k)
                        if check and meth != "bf16" and mode == self.modes[0]:
                            err = rel_err(out[:m], ref)
                            ex["rel_err"] = err
                            if not err <= 2e-3:
                                self.point_errors.append(
                                    f"{meth} {n}x{k} M={m}: rel_err {err:.3e} > 2e-3")
                                log(f"  WARNING {meth} {n}x{k} M={m}: rel_err {err:.3e}")
                        del out
                        graphs[meth] = C.capture_graph(
                            launch, L, between=None if mode == "b2b" else md.neighbour(mode),
                            device=DEV)
                        launches[meth] = L
                        ex.update(launches=L, copies=copies)
                except Exception as e:
                    msg = f"{meth} {n}x{k} M={m} {mode}: {type(e).__name__}: " \
                          f"{str(e).splitlines()[0][:300] if str(e) else ''}"
                    self.point_errors.append(msg)
                    log("  ERROR " + msg)
                    if os.environ.get("BENCH_TRACEBACK"):
                        traceback.print_exc()
                    sync()
            if not graphs:
                continue
            if mode != "b2b":
                le = max(launches.values())
                graphs["_elem"] = C.capture_graph(lambda i: None, le,
                                                  between=md.neighbour(mode), device=DEV)
                launches["_elem"] = le
            times = C.time_graphs_interleaved(graphs, args.replays, args.warmup_replays)
            per = {g: [t / launches[g] for t in ts] for g, ts in times.items()}
            elem_us = C.median(per["_elem"]) if "_elem" in per else 0.0
            for meth, ts in per.items():
                if meth == "_elem":
                    continue
                key = (meth, n, k, m, mode)
                reps = self.samples.setdefault(key, [])
                while len(reps) <= rep:
                    reps.append([])
                if mode != "b2b":
                    reps[rep].extend(t - elem_us for t in ts)
                    ex = self.extra.setdefault(key, {})
                    ex.setdefault("us_gross_samples", []).extend(ts)
                    ex.setdefault("us_elem_samples", []).append(elem_us)
                else:
                    reps[rep].extend(ts)
            if self.sampler is not None and mode == "b2b":
                for meth, g in graphs.items():
                    r = C.replay_alone(g, self.args.sustained, self.sampler)
                    ex = self.extra.setdefault((meth, n, k, m, mode), {})
                    ex.setdefault("us_sustained_samples", []).append(r["us"] / launches[meth])
                    ex.setdefault("clock_sustained_samples", []).append(r["clock_mhz"])
                    ex.setdefault("power_sustained_samples", []).append(r["power_w"])
            del graphs

    def rows(self):
        rows = []
        bw = self.bw["read_bw_gbps"]
        for key, reps in self.samples.items():
            meth, n, k, m, mode = key
            allt = [t for r in reps for t in r]
            if not allt:
                continue
            us = C.median(allt)
            ex = dict(self.extra.get(key, {}))
            wbytes = 2 * n * k if meth == "bf16" else C.fp8_weight_bytes(n, k)
            a_el = 2.0 if meth in ("bf16", "fp8linear_linear") else 1.0
            floor = wbytes / (bw * 1e3)
            row = {"method": meth, "M": m, "N": n, "K": k, "shape": C.shape_label(n, k),
                   "mode": mode, "us": us,
                   "us_reps": [C.median(r) for r in reps if r],
                   "us_p10": C.percentile(allt, 10), "us_p90": C.percentile(allt, 90),
                   "n_samples": len(allt),
                   "tflops": 2.0 * m * n * k / (us * 1e6),
                   "gbps": C.min_bytes(m, n, k, wbytes, a_el) / (us * 1e3),
                   "weight_bytes": wbytes, "floor_us": floor, "pct_floor": 100.0 * floor / us,
                   "fp8_floor_us": C.fp8_weight_bytes(n, k) / (bw * 1e3)}
            ur = row["us_reps"]
            row["rep_spread"] = (max(ur) / min(ur) - 1.0) if len(ur) > 1 else None
            if mode != "b2b":
                row["us_gross"] = C.median(ex.pop("us_gross_samples", []))
                row["us_elem"] = C.median(ex.pop("us_elem_samples", []))
            if "us_sustained_samples" in ex:
                row["us_sustained"] = C.median(ex.pop("us_sustained_samples"))
                row["clock_mhz_sustained"] = C.median(ex.pop("clock_sustained_samples"))
                row["power_w_sustained"] = C.median(ex.pop("power_sustained_samples"))
            row.update(ex)
            rows.append(row)
        C.add_derived(rows)
        rows.sort(key=lambda r: (C._shape_order(r["N"], r["K"]), r["M"], r["mode"],
                                 C.ALL_METHODS.index(r["method"])))
        return rows


def device_header(torch):
    if DEV == "cpu":
        return {"device": "cpu (dry run: plumbing only, timings meaningless)",
                "torch": torch.__version__, "date": C.utc_now(), "command": C.command_line(),
                "git_commit": C.git_commit()}
    p = torch.cuda.get_device_properties(0)
    h = {"device": torch.cuda.get_device_name(0),
         "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
         "sm_count": p.multi_processor_count,
         "l2_bytes": getattr(p, "L2_cache_size", None),
         "memory_bytes": p.total_memory,
         "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
         "date": C.utc_now(), "command": C.command_line(), "git_commit": C.git_commit()}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,"
                            "temperature.gpu,power.draw,power.limit", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        h["nvidia_smi"] = q.stdout.strip()
    except Exception:
        pass
    return h


def default_out(args, torch):
    slug = "cpu" if DEV == "cpu" else \
        torch.cuda.get_device_name(0).replace("NVIDIA ", "").replace(" ", "_").lower()
    tag = "decode" if args.decode else ("quick" if args.quick else "gemm")
    day = C.utc_now()[:10]
    return os.path.join(HERE, "results", f"{tag}_{slug}_{day}.json")


def main(argv=None) -> int:
    global DEV, T_START  # (the budget and the log's clock count from here, not from import)
    T_START = time.time()
    args = parse_args(argv)
    if args.cpu_dry_run:
        DEV = "cpu"
        os.environ["FP8LINEAR_BACKEND"] = "reference"
    if args.warm_worker:
        return warm_worker(args.warm_worker)
    import torch
    if DEV == "cuda" and not torch.cuda.is_available():
        print("bench_gemm: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False   # the fp32 reference is fp32
    methods = C.parse_methods(args.methods)
    shapes = C.parse_shapes(args.shapes or ("quick" if args.quick else "all"))
    ms = C.parse_ms(args.m or ("decode" if args.decode else ("quick" if args.quick else "all")))
    modes = ["b2b"]
    if args.decode:
        import neighbour
        for kind in filter(None, args.neighbours.split(",")):
            if kind not in neighbour.KINDS:
                print(f"bench_gemm: --neighbours {kind!r}: expected one of "
                      f"{', '.join(neighbour.KINDS)}", file=sys.stderr)
                return 2
            modes.append(kind)
    out = args.out or default_out(args, torch)
    header = device_header(torch)
    header.update(methods_requested=methods, shapes=shapes, ms=ms, modes=modes,
                  repeats=args.repeats, replays=args.replays,
                  warmup_replays=args.warmup_replays, min_copy_mb=args.min_mb,
                  timing="CUDA graph of L launches cycling R weight copies (> min_copy_mb); "
                         "us = median over all repeats of replay time / L; methods "
                         "interleaved replay by replay" + (
                             f"; with --sustained {args.sustained}: also each method's graph "
                             "alone for that long per point and repeat (us_sustained)"
                             if args.sustained > 0 else ""),
                  neighbour_ops={"elem": "torch.mul of [M, K] bf16 by [K], no PDL",
                                 "norm": "Triton RMSNorm of [M, K] bf16, no PDL",
                                 "norm_pdl": "the same launched with PDL, gdc_wait before "
                                             "its loads, gdc_launch_dependents after them "
                                             "(as Inductor's triton.enable_pdl)"})
    log(f"{header['device']} torch {torch.__version__} cuda {torch.version.cuda}")
    log(f"shapes {shapes}\n  M {ms}\n  methods {methods} modes {modes}")

    t = time.time()
    libs = Libs(methods)
    header.update(versions=libs.versions, cublas_variant=libs.cublas_variant,
                  cublas_probe=libs.cublas_probe, setup_s=time.time() - t)
    for meth, why in libs.dropped.items():
        log(f"dropped {meth}: {why}")
    header["methods_dropped"] = dict(libs.dropped)
    methods = [m for m in methods if m not in libs.dropped]
    header["methods"] = methods

    # JIT warm-up in parallel processes, before anything is timed
    workers = args.warm_workers
    if workers is None:
        workers = max(1, min(14, (os.cpu_count() or 4) - 2))
    if DEV != "cuda":
        workers = 0
    points = [(n, k, m) for (n, k) in shapes for m in ms]
    warm_timeout = args.warm_timeout
    if args.budget_s:   # leave at least half of the budget to the timed sweep
        warm_timeout = min(warm_timeout, 0.5 * args.budget_s)
    jit = parallel_warmup(points, methods, libs, workers, warm_timeout)
    header["jit"] = jit
    if jit["workers"]:
        log(f"JIT warm-up: {jit['items']} first calls in {jit['wall_s']:.1f}s on "
            f"{jit['workers']} processes; DeepGEMM kernels in cache "
            f"{jit.get('dg_kernels_before')} -> {jit.get('dg_kernels_after')}")
        for e in jit["errors"][:10]:
            log("  warm-up: " + e)

    bw = C.measure_read_bandwidth(args.bw_gib, device=DEV)
    header.update(bw)
    log(f"read bandwidth {bw['read_bw_gbps']:.0f} GB/s ({bw['read_bw_op']} over "
        f"{bw['read_bw_bytes'] / 2**30:.1f} GiB; {bw['read_bw_all_gbps']})")

    sweep = Sweep(args, libs, methods, shapes, ms, modes, bw)
    truncated = False
    for rep in range(args.repeats):
        for (n, k) in shapes:
            started = bool(sweep.samples)   # the first shape always runs
            if started and args.budget_s and time.time() - T_START > args.budget_s:
                truncated = True
                log(f"budget of {args.budget_s:.0f}s reached: stopping before repeat {rep} "
                    f"shape {n}x{k}")
                break
            log(f"repeat {rep} shape {n}x{k}")
            sd = sweep.shape_data(n, k)
            for m in ms:
                sweep.run_point(rep, sd, m)
            if (n, k) in sweep.cache:
                sweep.cache[(n, k)].w_deq = None   # the checks run in repeat 0 only
            del sd
            empty_cache()
            header.update(truncated=truncated, point_errors=sweep.point_errors,
                          elapsed_s=time.time() - T_START)
            C.write_json(out, header, sweep.rows())
        if truncated:
            break
    rows = sweep.rows()
    header.update(truncated=truncated, point_errors=sweep.point_errors,
                  elapsed_s=time.time() - T_START,
                  bw_end=C.measure_read_bandwidth(args.bw_gib, device=DEV))
    C.write_json(out, header, rows)
    log(f"wrote {out} ({len(rows)} rows)")
    if not args.no_plot:
        try:
            import plot
            for pth in plot.make_plots(rows, header, os.path.splitext(out)[0]):
                log(f"wrote {pth}")
        except Exception as e:
            log(f"plot failed: {type(e).__name__}: {e}")
    for mode in modes:
        print(C.format_rows(rows, mode=mode))
    print(C.target_summary(rows))
    if sweep.sampler is not None:
        sweep.sampler.stop()
    if sweep.point_errors:
        print(f"{len(sweep.point_errors)} point errors (see header.point_errors); first: "
              f"{sweep.point_errors[0]}")
    return 1 if any("rel_err" in e for e in sweep.point_errors) else 0


if __name__ == "__main__":
    sys.exit(main())
