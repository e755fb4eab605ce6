#!/usr/bin/env python3
"""CI kernel guard (no GPU needed): compile every csrc/**/*.cu for sm_90a as the library build
does.

Fails (exit 1, naming the TU and kernel) on a compile error, on any local-memory spill
reported by ``ptxas -v``, on wgmma serialisation (ptxas C7514/C7515/C7517: the compiler fell
back to waiting after every wgmma, silently halving a kernel's speed), or on a source that
includes torch or Python headers (the kernel library serves every torch and Python version).
Prints a compact table: kernel, registers, static smem, stack, spills.

    python scripts/check_kernels.py [--csrc DIR] [-j JOBS]

Exit status: 0 clean (or no .cu TU yet), 1 failures, 2 no CUDA toolkit.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


from fp8linear.backends.sm90 import build  # noqa: E402

_TORCH_INCLUDE = re.compile(
    r'^[ \t]*#[ \t]*include[ \t]*[<"](torch/|ATen/|c10/|caffe2/|pybind11/|Python\.h)', re.M)
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_WGMMA_SERIAL = re.compile(r"\((C751[4-9])\)[^']*'([^']+)'")


@dataclass
class Func:
    name: str
    regs: int | None = None
    smem: int = 0
    stack: int = 0
    spill_st: int = 0
    spill_ld: int = 0


@dataclass
class Result:
    tu: Path
    rc: int
    seconds: float
    output: str
    funcs: list[Func] = field(default_factory=list)


def torch_includes(csrc: Path) -> list[str]:
    """'file:line: include' for every torch-family or Python include."""
    bad = []
    for f in build.source_files(csrc):
        text = f.read_text(errors="replace")
        lines = text.splitlines()
        for m in _TORCH_INCLUDE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            bad.append(f"{f.relative_to(csrc)}:{line}: {lines[line - 1].strip()}")
    return bad


def parse_ptxas(text: str) -> list[Func]:
    """Per-function resources from ``ptxas -v`` output (entry kernels and non-inlined calls)."""
    funcs: dict[str, Func] = {}
    cur = None
    for line in text.splitlines():
        m = _ENTRY.search(line) or _PROPS.search(line)
        if m:
            cur = funcs.setdefault(m.group(1), Func(m.group(1)))
            continue
        if cur is None:
            continue
        if m := _FRAME.search(line):
            cur.stack, cur.spill_st, cur.spill_ld = (int(g) for g in m.groups())
        if m := _REGS.search(line):
            cur.regs = int(m.group(1))
            if s := _SMEM.search(line):
                cur.smem = int(s.group(1))
    return list(funcs.values())


def nvcc_command(nvcc: str, tu: Path, csrc: Path) -> list[str]:
    # The same flags as the JIT build (torch's defines included), output discarded.
    return ([nvcc] + build.nvcc_flags(build.ARCH)
            + build.PTXAS_VERBOSE + ["-I", str(csrc), "-c", str(tu), "-o", os.devnull])


def compile_tu(nvcc: str, tu: Path, csrc: Path) -> Result:
    t0 = time.time()
    p = subprocess.run(nvcc_command(nvcc, tu, csrc), capture_output=True, text=True,
                       errors="replace")
    out = p.stdout + p.stderr
    return Result(tu, p.returncode, time.time() - t0, out, parse_ptxas(out))


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    p = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    out = p.stdout.splitlines()
    return dict(zip(names, out)) if p.returncode == 0 and len(out) == len(names) else \
        {n: n for n in names}


def short(name: str, width: int = 64) -> str:
    """'void ns::kernel<args>(params)' -> 'kernel<args>', cut to width."""
    name = re.sub(r"^void ", "", name.replace("(anonymous namespace)::", ""))
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # drop the parameter list: first '(' outside <...>
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            cut = i
            break
    name = re.sub(r"^(\w+::)+", "", name[:cut])
    return name if len(name) <= width else name[:width - 3] + "..."


def _rel(tu: Path, csrc: Path) -> str:
    for base in (csrc, REPO):
        if tu.is_relative_to(base):
            return str(tu.relative_to(base))
    return str(tu)


def report(results: list[Result], csrc: Path) -> list[str]:
    """Prints the table; returns the failure lines."""
    failures = []
    names = demangle([f.name for r in results for f in r.funcs])
    rows = [("TU", "kernel", "regs", "smem", "stack", "spill st/ld", "s")]
    for r in results:
        rel = _rel(r.tu, csrc)
        if r.rc != 0:
            failures.append(f"{rel}: compile error (nvcc exit {r.rc}):\n"
                            + "\n".join(r.output.strip().splitlines()[-30:]))
            rows.append((rel, "COMPILE ERROR", "", "", "", "", f"{r.seconds:.1f}"))
            continue
        for code, fn in sorted(set(_WGMMA_SERIAL.findall(r.output))):
            failures.append(f"{rel}: {short(demangle([fn]).get(fn, fn), 200)}: wgmma serialised "
                            f"by ptxas ({code})")
        for f in r.funcs:
            if f.regs is None and not (f.stack or f.spill_st or f.spill_ld):
                continue  # a properties block with nothing in it
            if f.spill_st or f.spill_ld:
                failures.append(f"{rel}: {short(names[f.name], 200)} spills to local memory "
                                f"({f.spill_st} bytes stores, {f.spill_ld} bytes loads)")
            rows.append((rel, short(names[f.name]), "" if f.regs is None else str(f.regs),
                         str(f.smem), str(f.stack), f"{f.spill_st}/{f.spill_ld}",
                         f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))))
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csrc", type=Path, default=REPO / "csrc")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    csrc = args.csrc.resolve()

    failures = [f"{b}: no torch or Python headers in the kernel library" for b in torch_includes(csrc)]
    tus = sorted(csrc.rglob("*.cu"))
    if not tus:
        print(f"check_kernels: no .cu translation units under {csrc}; nothing to compile")
        return 1 if failures else 0
    home = build.find_cuda_home()
    if home is None:
        print("check_kernels: nvcc not found (set CUDA_HOME or install the CUDA toolkit)",
              file=sys.stderr)
        return 2
    nvcc = str(home / "bin" / "nvcc")
    t0 = time.time()
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        results = list(ex.map(lambda tu: compile_tu(nvcc, tu, csrc), tus))
    failures += report(results, csrc)
    print(f"check_kernels: {len(tus)} TUs for {build.ARCH} in {time.time() - t0:.1f}s "
          f"({args.jobs} jobs, {nvcc})")
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
