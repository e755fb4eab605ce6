"""CPU smoke test of benchmarks/e2e_decoder.py's model code on tiny sizes: the static-KV-cache
decode step agrees with a full causal prefill, the FP8 variants agree with BF16, the scaled_mm
variant feeds _scaled_mm the layouts cuBLASLt wants, and main() writes its JSON."""
import json

import pytest
import torch

import e2e_decoder as E


CPU = torch.device("cpu")


def _setup(variants=("bf16", "fp8linear"), layers=2, max_seq=32, cublas_variant=None,
           quant=None):
    cfg = dict(E.TINY, layers=layers)
    w = E.make_weights(cfg, CPU, seed=0)
    q = E.quantize_weights(w)
    models = E.build_models(cfg, w, q, list(variants), cublas_variant, quant, max_seq)
    return cfg, w, q, models


def _rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("variant", ["bf16", "fp8linear"])
def test_decode_steps_match_prefill(variant):
    """prefill(t[:4]) then 4 decode steps == prefill(t[:8]) at the last position."""
    cfg, _, _, models = _setup(variants=(variant,))
    m = models[variant]
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, cfg["vocab"], (3, 8), generator=g)
    with torch.no_grad():
        full_next, full_logits = m.prefill(toks, E.KVCache(cfg, 3, 32, CPU))
        cache = E.KVCache(cfg, 3, 32, CPU)
        m.prefill(toks[:, :4], cache)
        for p in range(4, 8):
            nxt, logits = m.step(toks[:, p], torch.tensor([p]), cache)
    assert logits.shape == (3, cfg["vocab"]) and nxt.shape == (3,)
    assert _rel(logits, full_logits) < 1e-2
    assert (nxt == full_next).float().mean() >= 2 / 3
    # the decode steps wrote positions 4..7 of the cache, nothing beyond
    assert cache.k[0][:, :, 4:8].abs().sum() > 0
    assert cache.k[0][:, :, 8:].abs().sum() == 0


def test_fp8_variant_close_to_bf16():
    cfg, _, _, models = _setup()
    toks = torch.randint(0, cfg["vocab"], (4, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = {v: models[v].prefill(toks, E.KVCache(cfg, 4, 32, CPU))[1] for v in models}
    err = _rel(out["fp8linear"], out["bf16"])
    assert 0 < err < 5e-2


def test_scaled_mm_layouts(monkeypatch):
    """ScaledMMLinear pads M to a multiple of 4 and passes M-major [Mp, Kb] activation scales;
    a stand-in for _scaled_mm that checks this and computes the blockwise product must give
    FP8Linear's result."""
    import bench_gemm
    import fp8linear
    from fp8linear.quant import expand_weight_scale

    calls = []

    def fake_cublas_call(variant, a, sa, w, ws):
        mp, k = a.shape
        assert mp % 4 == 0 and a.dtype == fp8linear.FP8_DTYPE
        assert sa.shape == (mp, -(-k // 128)) and sa.stride() == (1, mp)
        calls.append((variant, mp))
        af = fp8linear.dequantize_activation(a, sa.contiguous())
        wf = w.float() * expand_weight_scale(ws, w.shape[0]).repeat_interleave(128, 1)[:, :k]
        return (af @ wf.t()).to(torch.bfloat16)

    monkeypatch.setattr(bench_gemm, "cublas_call", fake_cublas_call)
    cfg, _, _, models = _setup(variants=("fp8linear", "scaled_mm"), layers=1,
                               cublas_variant="v1", quant=fp8linear.quantize_activation)
    with torch.no_grad():
        for b in (1, 3, 4):
            toks = torch.randint(0, cfg["vocab"], (b,), generator=torch.Generator().manual_seed(b))
            outs = {}
            for v in models:
                cache = E.KVCache(cfg, b, 32, CPU)
                outs[v] = models[v].step(toks, torch.tensor([0]), cache)[1]
            assert _rel(outs["scaled_mm"], outs["fp8linear"]) < 1e-2
    assert {mp for _, mp in calls} == {4}


def test_main_cpu_smoke(tmp_path):
    out = tmp_path / "dec.json"
    rc = E.main(["--device", "cpu", "--tiny", "--batches", "1,4", "--out", str(out),
                 "--no-plot", "--eager-calls", "10"])
    assert rc == 0
    d = json.loads(out.read_text())
    h, rows = d["header"], d["rows"]
    for key in ("device", "torch", "date", "command"):
        assert h[key]
    assert {(r["variant"], r["batch"]) for r in rows} >= {("bf16", 1), ("fp8linear", 4)}
    # no blockwise _scaled_mm on a CPU: dropped with the probe's reason, not an error
    assert h["scaled_mm_probe"] and h["scaled_mm_cublas_variant"] is None
    assert h["dropped"] == {"scaled_mm": "blockwise torch._scaled_mm unavailable or wrong "
                                         "here: " + "; ".join(h["scaled_mm_probe"])}
    assert "scaled_mm" not in {r["variant"] for r in rows}
    assert all(r["tok_s"] > 0 and r["step_ms"] > 0 for r in rows)
    assert [r["variant"] for r in h["host_overhead"]] == [v for v in ("bf16", "fp8linear")]
    assert h["eager_step"] and not h["errors"]
