#!/usr/bin/env python3
"""Plots and tables from bench_gemm.py JSON files (several parts of a split sweep merge).

  python benchmarks/plot.py benchmarks/results/gemm_a.json benchmarks/results/gemm_b.json \
      --out benchmarks/results/gemm_h100 [--table]

writes <out>_speedup.png (per shape: speedup of each method vs DeepGEMM over M) and, when
decode points are present, <out>_floor.png (per shape: % of the weight-read floor for M <= 256,
back to back solid, with an elementwise kernel between GEMMs dashed), plus <out>.json (the
merged rows) when more than one file is given.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

import common as C  # noqa: E402  (benchmarks/common.py, beside this script)

STYLE = {
    "fp8linear": ("tab:red", "o"), "fp8linear_linear": ("tab:orange", "s"),
    "fp8linear_triton": ("tab:pink", "^"), "deepgemm": ("tab:blue", "D"),
    "cublaslt_blockwise": ("tab:green", "v"), "vllm_triton": ("tab:purple", "P"),
    "bf16": ("tab:gray", "x"),
}


# the elem-mode (kernel between GEMMs) curves drawn; all are in the JSON and the tables
ELEM_SHOWN = ("fp8linear", "fp8linear_linear", "deepgemm")


def _shapes(rows):
    return sorted({(r["N"], r["K"]) for r in rows}, key=lambda s: C._shape_order(*s))


def _grid(n):
    cols = min(4, n)
    return cols, int(math.ceil(n / cols))


def _title(header):
    h = header or {}
    bw = h.get("read_bw_gbps")
    return (f"{h.get('device', '?')}, torch {h.get('torch', '?')}, {h.get('date', '')[:10]}"
            + (f", read BW {bw:.0f} GB/s" if bw else ""))


def make_plots(rows, header, prefix):
    """-> paths of the PNGs written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    C.add_derived(rows)
    paths = []
    shapes = _shapes(rows)
    if not shapes:
        return paths
    b2b = [r for r in rows if r.get("mode", "b2b") == "b2b"]
    anchor = "deepgemm" if any(r["method"] == "deepgemm" for r in b2b) else next(
        (a for a in C.ANCHORS if any(r["method"] == a for r in b2b)), None)
    if anchor:
        cols, nrows = _grid(len(shapes))
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
        for ax, (n, k) in zip(axes.flat, shapes):
            for meth in C.ALL_METHODS:
                if meth == anchor:
                    continue
                pts = sorted((r["M"], r[f"speedup_vs_{anchor}"]) for r in b2b
                             if r["method"] == meth and (r["N"], r["K"]) == (n, k)
                             and r.get(f"speedup_vs_{anchor}"))
                if pts:
                    col, mk = STYLE.get(meth, (None, "."))
                    ax.plot(*zip(*pts), marker=mk, ms=4, color=col, label=meth)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(C.shape_label(n, k), fontsize=9)
            ax.set_xlabel("M", fontsize=8)
            ax.set_ylabel(f"speedup vs {anchor}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(shapes):]:
            ax.axis("off")
        h, lab = _legend(axes)
        fig.legend(h, lab, loc="lower center", ncol=min(6, len(lab)), fontsize=8)
        fig.suptitle(f"block-FP8 GEMM, time of {anchor} / time of method (higher is faster); "
                     + _title(header), fontsize=10)
        fig.tight_layout(rect=(0, 0.05, 1, 0.96))
        p = prefix + "_speedup.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

    dec = [r for r in rows if r["M"] <= 256 and r.get("pct_floor")]
    if dec:
        dshapes = _shapes(dec)
        cols, nrows = _grid(len(dshapes))
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
        for ax, (n, k) in zip(axes.flat, dshapes):
            for meth in C.ALL_METHODS:
                for mode, ls in (("b2b", "-"), ("elem", "--")):
                    if mode == "elem" and meth not in ELEM_SHOWN:
                        continue
                    pts = sorted((r["M"], r["pct_floor"]) for r in dec
                                 if r["method"] == meth and (r["N"], r["K"]) == (n, k)
                                 and r.get("mode", "b2b") == mode)
                    if pts:
                        col, mk = STYLE.get(meth, (None, "."))
                        ax.plot(*zip(*pts), marker=mk, ms=4, color=col, ls=ls,
                                label=meth if mode == "b2b" else f"{meth} (elem between)")
            floor = next((r["fp8_floor_us"] for r in dec if (r["N"], r["K"]) == (n, k)), None)
            ax.axhline(85 if floor and floor >= 8 else 75, color="k", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 110)
            ax.set_title(C.shape_label(n, k) + (f", floor {floor:.1f} us" if floor else ""),
                         fontsize=9)
            ax.set_xlabel("M", fontsize=8)
            ax.set_ylabel("% of weight-read floor", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(dshapes):]:
            ax.axis("off")
        h, lab = _legend(axes)
        fig.legend(h, lab, loc="lower center", ncol=min(5, len(lab)), fontsize=8)
        fig.suptitle("decode: weight bytes / read bandwidth / time (dotted: issue 4 target); "
                     + _title(header), fontsize=10)
        fig.tight_layout(rect=(0, 0.07, 1, 0.96))
        p = prefix + "_floor.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def _legend(axes):
    seen = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    return list(seen.values()), list(seen.keys())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--out", default=None, help="output prefix (default: first file's name)")
    p.add_argument("--table", action="store_true", help="print the summary tables")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    headers, rows = C.load_json(a.json)
    C.add_derived(rows)
    prefix = a.out or os.path.splitext(a.json[0])[0]
    if len(a.json) > 1:
        hdr = dict(headers[0])
        hdr["merged_from"] = [{"file": f, "date": h.get("date"), "command": h.get("command"),
                               "read_bw_gbps": h.get("read_bw_gbps")}
                              for f, h in zip(a.json, headers)]
        C.write_json(prefix + ".json", hdr, rows)
        print(f"wrote {prefix}.json ({len(rows)} rows)")
    if not a.no_plot:
        for path in make_plots(rows, headers[0] if headers else {}, prefix):
            print(f"wrote {path}")
    if a.table:
        for mode in dict.fromkeys(r.get("mode", "b2b") for r in rows):  # (in row order)
            t = C.format_rows(rows, mode=mode)
            if t:
                print(t)
        print(C.target_summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
