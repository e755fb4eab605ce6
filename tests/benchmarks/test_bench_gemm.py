"""benchmarks/bench_gemm.py on the CPU (--cpu-dry-run: the plumbing with the torch reference
backend) and benchmarks/neighbour.py's argument checks."""
from __future__ import annotations

import json

import pytest
import torch

import bench_gemm
import neighbour


def test_decode_dry_run_times_each_neighbour_mode(tmp_path):
    out = tmp_path / "b.json"
    rc = bench_gemm.main(["--cpu-dry-run", "--decode", "--shapes", "256x384", "--m", "1,3",
                          "--methods", "fp8linear", "--repeats", "1", "--replays", "2",
                          "--neighbours", "elem", "--min-mb", "1", "--out", str(out),
                          "--no-plot", "--bw-gib", "0.01"])
    assert rc == 0
    d = json.loads(out.read_text())
    rows = d["rows"]
    assert {(r["mode"], r["M"]) for r in rows} == {(md, m) for md in ("b2b", "elem")
                                                   for m in (1, 3)}
    assert d["header"]["modes"] == ["b2b", "elem"]
    for r in rows:
        # the correctness check runs once a point, on its back-to-back timing
        if r["mode"] == "b2b":
            assert 0 < r["rel_err"] <= 2e-3
        else:
            assert "rel_err" not in r
        assert r["us"] > 0 and r["N"] == 256 and r["K"] == 384
        if r["mode"] == "elem":  # the GEMM's share: gross time minus the neighbour's
            assert r["us_gross"] > 0 and r["us_elem"] > 0


def test_unknown_neighbour_is_refused(tmp_path, capsys):
    rc = bench_gemm.main(["--cpu-dry-run", "--decode", "--shapes", "256x384", "--m", "1",
                          "--neighbours", "rmsnorm", "--out", str(tmp_path / "b.json")])
    assert rc == 2
    assert "expected one of elem, norm, norm_pdl" in capsys.readouterr().err
    with pytest.raises(ValueError, match="neighbour kind 'bogus'"):
        neighbour.make("bogus", None, None, None)


def test_elem_neighbour_multiplies():
    x = torch.randn(3, 256).bfloat16()
    g = torch.randn(256).bfloat16()
    o = torch.full_like(x, float("nan"))
    neighbour.make("elem", x, g, o)()
    assert torch.equal(o, x * g)


def test_sustained_speedups_and_summary():
    """--sustained rows: sustained_speedup_vs_<anchor> from us_sustained, beside the
    interleaved speedup, and a line of their own in the issue-3 summary."""
    import common as C
    rows = []
    for m, ours, dg, ours_s, dg_s in ((4096, 100.0, 95.0, 110.0, 104.5),
                                      (8192, 200.0, 210.0, 220.0, 231.0)):
        rows.append({"method": "fp8linear", "N": 8192, "K": 8192, "M": m, "mode": "b2b",
                     "us": ours, "us_sustained": ours_s})
        rows.append({"method": "deepgemm", "N": 8192, "K": 8192, "M": m, "mode": "b2b",
                     "us": dg, "us_sustained": dg_s})
    C.add_derived(rows)
    r4 = rows[0]
    assert r4["speedup_vs_deepgemm"] == pytest.approx(0.95)
    assert r4["sustained_speedup_vs_deepgemm"] == pytest.approx(0.95)
    assert rows[2]["sustained_speedup_vs_deepgemm"] == pytest.approx(1.05)
    text = C.target_summary(rows)
    line = [s for s in text.splitlines() if "run alone" in s]
    assert len(line) == 1, text
    assert "geomean 0.999" in line[0] and "min 0.950 at 8192x8192 M=4096" in line[0], line[0]
    # rows without sustained times get no sustained speedup and no summary line
    plain = [dict(r) for r in rows]
    for r in plain:
        r.pop("us_sustained")
    C.add_derived(plain)
    assert "sustained_speedup_vs_deepgemm" not in plain[0]
    assert "run alone" not in C.target_summary(plain)
