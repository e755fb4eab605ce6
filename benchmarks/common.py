"""Helpers shared by the GEMM benchmark and its plotter: shapes, CLI parsing, CUDA-graph timing,
the read-bandwidth floor, statistics, JSON I/O and the summary tables.

Pure-Python parts (parsing, statistics, summaries) import nothing but the standard library, so
they run and can be checked on a machine without a GPU; the timing helpers need torch + CUDA.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

# ------------------------------------------------------------------------------ shapes
# (model, N, K): the benchmark list of issue 3 (DeepSeek-V3, Llama-3.1-8B, Llama-3.1-70B).
SHAPES = [
    ("ds", 2112, 7168), ("ds", 24576, 1536), ("ds", 32768, 512), ("ds", 7168, 16384),
    ("ds", 4096, 7168), ("ds", 7168, 2048),
    ("llama8b", 6144, 4096), ("llama8b", 4096, 4096), ("llama8b", 28672, 4096),
    ("llama8b", 4096, 14336),
    ("llama70b", 10240, 8192), ("llama70b", 8192, 8192), ("llama70b", 57344, 8192),
    ("llama70b", 8192, 28672),
]
M_ALL = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
M_DECODE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# --quick: one shape per model family plus the largest DeepSeek one, M at the points the
# targets of issues 3 and 4 name.
QUICK_SHAPES = [(2112, 7168), (7168, 16384), (4096, 4096), (8192, 8192)]
QUICK_M = [1, 4, 16, 64, 256, 1024, 4096]

# The anchors every fp8linear row is compared with.
ANCHORS = ("deepgemm", "cublaslt_blockwise", "vllm_triton", "bf16")
OURS = ("fp8linear", "fp8linear_linear", "fp8linear_triton")
ALL_METHODS = OURS + ANCHORS


def shape_label(n: int, k: int) -> str:
    for model, nn, kk in SHAPES:
        if (nn, kk) == (n, k):
            return f"{model} {n}x{k}"
    return f"{n}x{k}"


def parse_shapes(spec: str | None) -> list[tuple[int, int]]:
    """'all' | 'quick' | model names (ds, llama8b, llama70b) | indices into SHAPES | NxK,
    comma-separated and mixed; order kept, duplicates dropped. Used to split the sweep."""
    if not spec or spec == "all":
        return [(n, k) for _, n, k in SHAPES]
    out: list[tuple[int, int]] = []
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        if tok == "quick":
            picked = list(QUICK_SHAPES)
        elif tok in {m for m, _, _ in SHAPES}:
            picked = [(n, k) for m, n, k in SHAPES if m == tok]
        elif tok.isdigit():
            i = int(tok)
            if not 0 <= i < len(SHAPES):
                raise ValueError(f"shape index {i} out of range 0..{len(SHAPES) - 1}")
            picked = [SHAPES[i][1:]]
        elif "x" in tok.lower():
            n, k = tok.lower().split("x")
            picked = [(int(n), int(k))]
        else:
            raise ValueError(f"bad shape {tok!r}: use all, quick, ds, llama8b, llama70b, an "
                             f"index 0..{len(SHAPES) - 1} or NxK")
        for s in picked:
            if s not in out:
                out.append(s)
    return out


def parse_ms(spec: str | None) -> list[int]:
    """'all' | 'decode' (1..256) | 'large' (>= 512) | 'quick' | 'A-B' (range over M_ALL) |
    integers; comma-separated and mixed, sorted, duplicates dropped."""
    if not spec or spec == "all":
        return list(M_ALL)
    out: set[int] = set()
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        if tok == "decode":
            out.update(M_DECODE)
        elif tok == "large":
            out.update(m for m in M_ALL if m >= 512)
        elif tok == "quick":
            out.update(QUICK_M)
        elif "-" in tok:
            lo, hi = (int(v) for v in tok.split("-"))
            out.update(m for m in M_ALL if lo <= m <= hi)
        else:
            m = int(tok)
            if m < 1:
                raise ValueError(f"M must be >= 1, got {m}")
            out.add(m)
    return sorted(out)


def parse_methods(spec: str | None) -> list[str]:
    if not spec or spec == "all":
        return list(ALL_METHODS)
    out = []
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        if tok not in ALL_METHODS:
            raise ValueError(f"unknown method {tok!r}: one of {', '.join(ALL_METHODS)}")
        if tok not in out:
            out.append(tok)
    return out


# ------------------------------------------------------------------- sizes and plans
def copies_for(bytes_per_copy: int, min_total: float) -> int:
    """Fewest copies whose bytes together exceed min_total (at least one)."""
    return max(1, int(min_total // bytes_per_copy) + 1)


def launches_for(copies: int, est_us: float, target_us: float = 300.0, max_cycles: int = 4) -> int:
    """Launches in one graph: whole cycles over the copies (every copy read equally often),
    enough that a replay lasts ~target_us so the graph's own launch cost is amortised,
    at most max_cycles cycles."""
    cycles = max(1, min(max_cycles, math.ceil(target_us / max(copies * est_us, 1e-3))))
    return copies * cycles


def est_us(m: int, n: int, k: int, tflops: float = 1000.0, tbps: float = 3.0) -> float:
    """Rough time of one fp8 GEMM (roofline with H100-like rates), only to size graphs."""
    return max(2.0 * m * n * k / (tflops * 1e6), n * k / (tbps * 1e6), 3.0)


def fp8_weight_bytes(n: int, k: int) -> int:
    """fp8 weight + fp32 128x128 block scales: what a decode GEMM must read at least."""
    return n * k + 4 * (-(-n // 128)) * (-(-k // 128))


def m_major_scales(a_scale, m: int):
    """Activation scales [M, Kb] as DeepGEMM takes them and our large-M kernel reads them in
    place: strides (1, ld), ld = M rounded up to 4 (16-byte TMA rows); DeepGEMM's own helper
    makes exactly this."""
    from fp8linear.quant import empty_scale_t, scale_view
    view = scale_view(empty_scale_t(m, a_scale.shape[1], a_scale.device), m)
    view.copy_(a_scale)
    return view


def min_bytes(m: int, n: int, k: int, weight_bytes: int, a_bytes_per_el: float = 1.0,
              out_bytes_per_el: int = 2) -> int:
    """Each input read once and the output written once."""
    a = m * k * a_bytes_per_el + (4 * m * (-(-k // 128)) if a_bytes_per_el == 1.0 else 0)
    return int(weight_bytes + a + m * n * out_bytes_per_el)


# -------------------------------------------------------------------------- statistics
def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def geomean(xs: Iterable[float]) -> float:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


# -------------------------------------------------------------------------- CUDA timing
class CpuGraph:
    """Stand-in for a CUDA graph on the CPU (dry runs of the benchmark's plumbing only)."""

    def __init__(self, launch, launches, between):
        self.launch, self.launches, self.between = launch, launches, between

    def replay(self):
        for i in range(self.launches):
            if self.between is not None:
                self.between(i)
            self.launch(i)


def capture_graph(launch: Callable[[int], object], launches: int, warmup_calls: int = 2,
                  between: Callable[[int], object] | None = None, pool=None,
                  device: str = "cuda"):
    """One CUDA graph holding `launches` calls launch(0..launches-1) (each optionally preceded
    by between(i)). Warm-up calls run eagerly on a side stream first (lazy init, cuBLAS
    workspaces, JIT); outputs are dropped, so the graph's private pool reuses their memory."""
    if device == "cpu":
        return CpuGraph(launch, launches, between)
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(warmup_calls, launches)):
            if between is not None:
                between(i)
            launch(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        for i in range(launches):
            if between is not None:
                between(i)
            launch(i)
    torch.cuda.synchronize()
    return g


def time_graphs_interleaved(graphs: dict, replays: int, warmup: int = 3) -> dict:
    """Replays every graph `warmup + replays` times, one replay of each method in turn (the
    order rotating every round so no method always follows the same one), each replay between
    two CUDA events. Returns {name: [µs per replay]} for the timed replays. One host sync at
    the end: the GPU runs the replays back to back."""
    names = list(graphs)
    if any(isinstance(g, CpuGraph) for g in graphs.values()):
        res = {n: [] for n in names}
        for r in range(warmup + replays):
            rot = r % len(names)
            for n in names[rot:] + names[:rot]:
                t = time.perf_counter()
                graphs[n].replay()
                if r >= warmup:
                    res[n].append((time.perf_counter() - t) * 1e6)
        return res
    import torch
    evs = {n: [] for n in names}
    for r in range(warmup + replays):
        rot = r % len(names)
        for n in names[rot:] + names[:rot]:
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            graphs[n].replay()
            e1.record()
            if r >= warmup:
                evs[n].append((e0, e1))
    torch.cuda.synchronize()
    return {n: [a.elapsed_time(b) * 1e3 for a, b in evs[n]] for n in names}


class ClockSampler:
    """nvidia-smi sampling the SM clock and power every 20 ms in a background thread, for
    runs at the power cap (stop() when done)."""

    def __init__(self):
        self.samples = []  # (wall time, SM clock MHz, power W), stamped as each line arrives
        self._smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
             "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.stop)  # never leave nvidia-smi running behind an early exit

    def _read(self):
        for line in self._smi.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((time.time(), float(parts[1]), float(parts[2])))
            except (ValueError, IndexError):
                pass

    def window(self, t0: float, t1: float) -> tuple[float, float, int]:
        """Median SM clock (MHz) and power (W) of the samples in [t0, t1], and their count."""
        win = [s for s in self.samples if t0 <= s[0] <= t1]
        if not win:
            return float("nan"), float("nan"), 0
        return (statistics.median(s[1] for s in win), statistics.median(s[2] for s in win),
                len(win))

    def stop(self):
        if self._smi.poll() is None:
            self._smi.terminate()


def replay_alone(graph, seconds: float, sampler: ClockSampler, settle_s: float = 0.3) -> dict:
    """Replays one CUDA graph back to back for `seconds` (nothing else on the GPU), as a
    model's prefill runs its GEMMs at the power cap, where an interleaved A/B (one shared
    clock) under-charges a kernel that draws more power. Returns us per replay (CUDA events)
    and the median SM clock and power after `settle_s`."""
    import torch
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.time()
    e0 = torch.cuda.Event(enable_timing=True)
    e1 = torch.cuda.Event(enable_timing=True)
    e0.record()
    count = 0
    while time.time() - t0 < seconds:
        graph.replay()
        count += 1
        if count % 4 == 0:
            torch.cuda.synchronize()
    e1.record()
    e1.synchronize()
    t1 = time.time()
    time.sleep(0.1)  # the sampler's last lines
    clk, power, n = sampler.window(t0 + settle_s, t1)
    return {"us": e0.elapsed_time(e1) * 1000 / count, "clock_mhz": clk, "power_w": power,
            "samples": n}


def measure_read_bandwidth(gib: float = 2.0, iters: int = 20, device: str = "cuda") -> dict:
    """Read-only reductions over a >= 1 GiB fp32 buffer (sum and amax: one pass, no writes
    but a scalar); bytes read / median time, the best of the two. The floor of a decode GEMM
    is weight bytes / this."""
    import torch
    n = int(gib * 2**30) // 4
    buf = torch.empty(n, dtype=torch.float32, device=device).uniform_(-1, 1)
    res = {}
    for name, fn in (("sum", torch.sum), ("amax", torch.amax)):
        for _ in range(3):
            fn(buf)
        if device == "cpu":
            ts = []
            for _ in range(iters):
                t = time.perf_counter()
                fn(buf)
                ts.append((time.perf_counter() - t) * 1e6)
            res[name] = n * 4 / (median(ts) * 1e-6) / 1e9
            continue
        ts = []
        for _ in range(iters):
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            fn(buf)
            e1.record()
            ts.append((e0, e1))
        torch.cuda.synchronize()
        us = median([a.elapsed_time(b) * 1e3 for a, b in ts])
        res[name] = n * 4 / (us * 1e-6) / 1e9
    del buf
    if device != "cpu":
        torch.cuda.empty_cache()
    best = max(res, key=res.get)
    return {"read_bw_gbps": res[best], "read_bw_op": best, "read_bw_all_gbps": res,
            "read_bw_bytes": n * 4}


# ------------------------------------------------------------------------------- output
def write_shards(path: str, tensors: Iterable, shard_bytes: float) -> int:
    """(name, tensor) pairs into model-NNNNN.safetensors files of about shard_bytes each and
    their model.safetensors.index.json; returns the tensor bytes written."""
    from safetensors.torch import save_file
    weight_map, shard, size, total, k = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, size, k
        if shard:
            name = f"model-{k:05d}.safetensors"
            save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
            weight_map.update({n: name for n in shard})
            shard, size, k = {}, 0, k + 1

    for name, t in tensors:
        nb = t.numel() * t.element_size()
        if size and size + nb > shard_bytes:
            flush()
        shard[name], size, total = t.contiguous(), size + nb, total + nb
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)
    return total


def git_commit() -> str | None:
    """HEAD's commit (FP8LINEAR_GIT_COMMIT where set: a copy of the tree whose .git is not
    its own, as on the GPU machine), flagged when the code under it is modified in the work
    tree: then HEAD did not produce the result alone."""
    if os.environ.get("FP8LINEAR_GIT_COMMIT"):
        return os.environ["FP8LINEAR_GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        c = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                           text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain",
                                "--untracked-files=no", "--", "../fp8linear", "../integrations",
                                "../csrc"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return (c + (" (fp8linear/, integrations/ or csrc/ modified in the work tree)"
                 if dirty.strip() else "")) or None


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def command_line() -> str:
    return " ".join([os.path.basename(sys.executable)] + sys.argv)


def write_json(path: str, header: dict, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1, default=_json_default)
    os.replace(tmp, path)


@contextlib.contextmanager
def new_folder(out):
    """A temporary folder beside ``out`` to write a checkpoint into. On success it becomes
    ``out``, readable by all (as ``fp8linear quantize`` swaps its output in); on any error it
    is removed and ``out`` stays as it was."""
    from fp8linear.checkpoint.convert import swap_in
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # (mkdtemp's 0700: a server under another account could not read it)
        for p in tmp.iterdir():
            os.chmod(p, 0o644)
        swap_in(tmp, out)
    except BaseException:  # KeyboardInterrupt too: never a partial folder left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def load_json(paths: Sequence[str]) -> tuple[list[dict], list[dict]]:
    """-> (headers, rows); rows of later files replace rows with the same key."""
    headers, rows = [], {}
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        headers.append(d.get("header", {}))
        for r in d.get("rows", []):
            rows[row_key(r)] = r
    return headers, list(rows.values())


def row_key(r: dict) -> tuple:
    return (r["method"], r["N"], r["K"], r["M"], r.get("mode", "b2b"))


def add_derived(rows: list[dict]) -> None:
    """speedup_vs_<anchor> = anchor µs / row µs, for rows of the same (N, K, M, mode)."""
    by = {}
    for r in rows:
        by.setdefault((r["N"], r["K"], r["M"], r.get("mode", "b2b")), {})[r["method"]] = r
    for group in by.values():
        for r in group.values():
            for a in ANCHORS:
                for us, name in (("us", f"speedup_vs_{a}"),
                                 ("us_sustained", f"sustained_speedup_vs_{a}")):
                    if a in group and a != r["method"] and group[a].get(us) and r.get(us):
                        r[name] = group[a][us] / r[us]
                    else:
                        r.pop(name, None)


# ---------------------------------------------------------------------- summary tables
def _fmt(v, spec=".1f", width=8):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-".rjust(width)
    return format(v, spec).rjust(width)


def format_rows(rows: list[dict], methods: Sequence[str] | None = None, mode: str = "b2b",
                field: str = "us") -> str:
    """One line per (shape, M): `field` of every method side by side, then the fp8linear
    row's speedup vs DeepGEMM and % of the weight-read floor."""
    rs = [r for r in rows if r.get("mode", "b2b") == mode]
    if not rs:
        return ""
    present = [m for m in (methods or ALL_METHODS) if any(r["method"] == m for r in rs)]
    short = {"fp8linear": "ours", "fp8linear_linear": "ours+q", "fp8linear_triton": "ours_tri",
             "deepgemm": "deepgemm", "cublaslt_blockwise": "cublasLt", "vllm_triton": "vllm_tri",
             "bf16": "bf16"}
    head = f"{'N x K':>12} {'M':>5} " + " ".join(short.get(m, m)[:8].rjust(8) for m in present)
    head += f" {'vsDG':>6} {'%floor':>6}"
    lines = [f"[{mode}] {field} per GEMM", head]
    by = {}
    for r in rs:
        by.setdefault((r["N"], r["K"], r["M"]), {})[r["method"]] = r
    for (n, k, m) in sorted(by, key=lambda t: (_shape_order(t[0], t[1]), t[2])):
        g = by[(n, k, m)]
        line = f"{f'{n}x{k}':>12} {m:>5} " + " ".join(
            _fmt(g[x].get(field) if x in g else None) for x in present)
        ours = g.get("fp8linear", {})
        line += " " + _fmt(ours.get("speedup_vs_deepgemm"), ".2f", 6)
        line += " " + _fmt(ours.get("pct_floor"), ".0f", 6)
        lines.append(line)
    return "\n".join(lines)


def _shape_order(n, k):
    for i, (_, nn, kk) in enumerate(SHAPES):
        if (nn, kk) == (n, k):
            return i
    return len(SHAPES) + n * 1e-6 + k * 1e-12


def target_summary(rows: list[dict], method: str = "fp8linear") -> str:
    """The targets of issues 3 and 4 for `method` against DeepGEMM (b2b rows)."""
    rs = [r for r in rows if r["method"] == method and r.get("mode", "b2b") == "b2b"]
    out = []

    def band(lo, hi):
        return [r for r in rs if lo <= r["M"] <= hi and r.get("speedup_vs_deepgemm")]

    for name, lo, hi, need_geo, need_min in (
            ("M>=512 (issue 3)", 512, 1 << 30, 1.05, 0.97),
            ("M 1-16 (issue 4)", 1, 16, 1.2, 0.97),
            ("M 32-256 (issue 4)", 32, 256, 1.1, 0.97)):
        b = band(lo, hi)
        if not b:
            continue
        sp = [r["speedup_vs_deepgemm"] for r in b]
        g, mn = geomean(sp), min(sp)
        worst = min(b, key=lambda r: r["speedup_vs_deepgemm"])
        ok = g >= need_geo and mn >= need_min
        out.append(f"{method} vs deepgemm {name}: geomean {g:.3f} (need {need_geo}), "
                   f"min {mn:.3f} at {worst['N']}x{worst['K']} M={worst['M']} "
                   f"(need {need_min}) over {len(b)} points -> {'PASS' if ok else 'FAIL'}")
        ss = [r for r in b if r.get("sustained_speedup_vs_deepgemm")]
        if ss:
            sp = [r["sustained_speedup_vs_deepgemm"] for r in ss]
            worst = min(ss, key=lambda r: r["sustained_speedup_vs_deepgemm"])
            out.append(f"{method} vs deepgemm {name}, each run alone (--sustained): geomean "
                       f"{geomean(sp):.3f}, min {min(sp):.3f} at {worst['N']}x{worst['K']} "
                       f"M={worst['M']} over {len(sp)} points")
    # decode runs: the same bands with a kernel between GEMMs, as in a model (benchmarks/
    # neighbour.py: elem = an elementwise kernel, norm_pdl = a PDL-aware norm as Inductor's)
    from neighbour import KINDS      # (beside this file, as bench_gemm imports it)
    modes = [md for md in KINDS if any(r.get("mode") == md for r in rows)]
    for mode in modes:
        el = [r for r in rows if r["method"] == method and r.get("mode") == mode
              and r.get("speedup_vs_deepgemm")]
        for name, lo, hi in (("M 1-16", 1, 16), ("M 32-256", 32, 256)):
            sp = [r["speedup_vs_deepgemm"] for r in el if lo <= r["M"] <= hi]
            if sp:
                out.append(f"{method} vs deepgemm {name}, {KINDS[mode]} between "
                           f"GEMMs: geomean {geomean(sp):.3f}, min {min(sp):.3f} over "
                           f"{len(sp)} points")
    # issue 4: fp8_linear (quantization included) within 1 us of the GEMM alone at M <= 16
    lin = {(r.get("mode", "b2b"), r["N"], r["K"], r["M"]): r["us"] for r in rows
           if r["method"] == "fp8linear_linear" and r["M"] <= 16}
    for mode in ["b2b"] + modes:
        gaps = sorted(lin[(mode, r["N"], r["K"], r["M"])] - r["us"] for r in rows
                      if r["method"] == method and r.get("mode", "b2b") == mode
                      and (mode, r["N"], r["K"], r["M"]) in lin)
        if gaps:
            over = sum(g > 1.0 for g in gaps)
            out.append(f"fp8linear_linear - {method}, M<=16, {mode}: median "
                       f"{gaps[len(gaps) // 2]:+.2f} us, max {gaps[-1]:+.2f} us; {over} of "
                       f"{len(gaps)} over 1 us -> {'PASS' if not over else 'FAIL'}")
    dec = [r for r in rs if r["M"] <= 16 and r.get("pct_floor")]
    if dec:
        fails = [r for r in dec
                 if r["pct_floor"] < (85.0 if r.get("floor_us", 0) >= 8.0 else 75.0)]
        out.append(f"{method} % of weight-read floor, M<=16: min "
                   f"{min(r['pct_floor'] for r in dec):.0f}% over {len(dec)} points; "
                   f"{len(fails)} below target (85% where floor >= 8 us, else 75%)")
    return "\n".join(out)
