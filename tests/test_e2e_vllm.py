"""CPU test of benchmarks/e2e_vllm.py's --merge (no vLLM needed): engines of several runs in
one document with recomputed targets, the later run's engine of a name winning, and the
refusals (runs of other workloads, no --out); and of the MoE model's checkpoint stage."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def E():
    spec = importlib.util.spec_from_file_location(
        "e2e_vllm", os.path.join(ROOT, "benchmarks", "e2e_vllm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(path, engines, **header):
    h = {"model": {"layers": 32}, "batches": [1, 4], "prompt_len": 128, "out_len": 128,
         "compile": "vllm", "date": "2026-11-25T00:00:00Z", "device": "H100", **header}
    doc = {"header": h, "engines": {
        name: {"decode": [{"batch": b, "per_token_ms": ms, "decode_tok_s": b * 1e3 / ms}
                          for b, ms in zip(h["batches"], per)], "start_s": 30.0,
               "weight_gib": 8.46}
        for name, per in engines.items()}}
    path.write_text(json.dumps(doc))
    return str(path)


def test_merge_combines_runs_and_recomputes_targets(E, tmp_path, capsys):
    a = _run(tmp_path / "a.json", {"fp8_blockgemm": [4.0, 4.0], "fp8_cutlass": [4.6, 5.6]})
    b = _run(tmp_path / "b.json", {"fp8_deepgemm": [4.7, 4.2], "fp8_blockgemm": [3.8, 3.7]})
    out = tmp_path / "m.json"
    assert E.main(["--merge", a, b, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["engines"]) == ["fp8_blockgemm", "fp8_cutlass", "fp8_deepgemm"]
    assert [d["per_token_ms"] for d in doc["engines"]["fp8_blockgemm"]["decode"]] == [3.8, 3.7]
    assert sorted((r["config"], r["batch"], r["per_token_ms"]) for r in doc["rows"]) == [
        ("fp8_blockgemm", 1, 3.8), ("fp8_blockgemm", 4, 3.7), ("fp8_cutlass", 1, 4.6),
        ("fp8_cutlass", 4, 5.6), ("fp8_deepgemm", 1, 4.7), ("fp8_deepgemm", 4, 4.2)]
    # best vLLM fp8: 4.6 (CUTLASS) at batch 1, 4.2 (DeepGEMM) at batch 4
    assert doc["targets"]["fp8_blockgemm vs best vLLM fp8 (need >= 1.15x)"] == \
        "b1 1.21x PASS, b4 1.14x FAIL"
    assert [m["file"] for m in doc["header"]["merged_from"]] == ["a.json", "b.json"]
    assert (tmp_path / "m.png").stat().st_size > 0
    assert "fp8_deepgemm" in capsys.readouterr().out


def test_merge_refuses_other_workloads_and_a_missing_out(E, tmp_path, capsys):
    a = _run(tmp_path / "a.json", {"fp8_blockgemm": [4.0, 4.0]})
    b = _run(tmp_path / "b.json", {"fp8_cutlass": [4.6, 5.6]}, compile="none")
    with pytest.raises(SystemExit, match=r"--merge: \['compile'\] differ between"):
        E.main(["--merge", a, b, "--out", str(tmp_path / "m.json")])
    with pytest.raises(SystemExit):
        E.main(["--merge", a, b])
    assert "--merge needs --out" in capsys.readouterr().err


def test_merge_keeps_a_renamed_run_and_compares_prompt_logprobs_across_runs(E, tmp_path):
    """JSON@SUFFIX keeps a run with other settings beside the same engines (its anchors
    still count for the target); batch lists may differ; an engine scored apart from bf16
    compares on the prompt's log-probabilities only."""
    n = E.LP_PROMPT_LEN - 1
    a = _run(tmp_path / "a.json", {"fp8_blockgemm": [4.0, 4.0, 9.0],
                                   "fp8_cutlass": [4.4, 5.6, 26.0]}, batches=[1, 4, 256])
    b = _run(tmp_path / "b.json", {"bf16": [6.5, 6.5, 12.0]}, batches=[1, 4, 256])
    c = _run(tmp_path / "c.json", {"fp8_blockgemm": [3.8, 3.7]})
    docs = {p: json.loads(open(p).read()) for p in (b, c)}
    seq = list(range(n + 1 + 3))
    docs[b]["engines"]["bf16"].update(tf_seq=seq, tf_logprobs=[-1.0] * (len(seq) - 1),
                                      tf_top1=[0] * (len(seq) - 1))
    # c's engine ran without bf16: its prompt part +0.5 off, its own continuation far off
    docs[c]["engines"]["fp8_blockgemm"].update(tf_logprobs=[-1.5] * n + [-9.0] * 3)
    for p, d in docs.items():
        open(p, "w").write(json.dumps(d))
    out = tmp_path / "m.json"
    assert E.main(["--merge", a + "@_seqs256", b, c, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["engines"]) == ["fp8_blockgemm_seqs256", "fp8_cutlass_seqs256", "bf16",
                                    "fp8_blockgemm"]
    assert doc["header"]["batches"] == [1, 4, 256]
    t = doc["targets"]
    assert t["fp8_blockgemm vs best vLLM fp8 (need >= 1.15x)"] == \
        "b1 1.16x PASS, b4 1.51x PASS"                      # 4.4 / 3.8, 5.6 / 3.7
    assert t["fp8_blockgemm_seqs256 faster than bf16 at batch 256"] == \
        "9.00 vs 12.00 ms PASS"
    lp = doc["logprobs"]["fp8_blockgemm"]
    assert lp["scored"] == "prompt only" and lp["greedy_abs_dlogprob_mean"] is None
    assert lp["prompt_abs_dlogprob_mean"] == pytest.approx(0.5)


def test_merge_renames_only_the_named_engines(E, tmp_path):
    """JSON@SUFFIX:A,B renames A and B only: a run of BF16 and our engine at max_num_seqs 256
    keeps its bf16 as the reference while our engine sits beside the batch 1-64 run's."""
    a = _run(tmp_path / "a.json", {"fp8_blockgemm": [4.0, 4.0], "bf16": [6.5, 6.6]})
    b = _run(tmp_path / "b.json", {"fp8_blockgemm": [3.8, 3.7]})
    out = tmp_path / "m.json"
    assert E.main(["--merge", a + "@_seqs256:fp8_blockgemm", b, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["engines"]) == ["fp8_blockgemm_seqs256", "bf16", "fp8_blockgemm"]
    assert doc["engines"]["fp8_blockgemm_seqs256"]["name"] == "fp8_blockgemm_seqs256"
    assert doc["targets"]["fp8_blockgemm speedup vs bf16"] == "b1 1.71x, b4 1.78x"


def test_moe_models_stage_writes_block_fp8_experts_and_a_bf16_config(E, tmp_path):
    """--shape tiny_moe (Qwen3-MoE's architecture, small): the FP8 checkpoint written
    directly, routers kept bf16 and listed as ignored; BF16 is a config for dummy weights."""
    from safetensors import safe_open
    work = tmp_path / "w"
    assert E.main(["--stage", "models", "--shape", "tiny_moe", "--layers", "2",
                   "--work", str(work)]) == 0
    cfg = json.loads((work / "fp8" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_hidden_layers"] == 2
    assert cfg["quantization_config"]["ignored_layers"] == [
        "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert sorted(os.listdir(work / "bf16")) == ["config.json"]
    assert "quantization_config" not in json.loads((work / "bf16" / "config.json").read_text())
    with safe_open(str(work / "fp8" / "model-00000.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.1.mlp.experts.7.down_proj.weight")
        s = f.get_tensor("model.layers.1.mlp.experts.7.down_proj.weight_scale_inv")
        assert str(w.dtype) == "torch.float8_e4m3fn" and tuple(w.shape) == (256, 256)
        assert tuple(s.shape) == (2, 2) and bool((s > 0).all())
        assert str(f.get_tensor("model.layers.0.mlp.gate.weight").dtype) == "torch.bfloat16"
