"""CPU test of benchmarks/e2e_vllm.py's --merge (no vLLM needed): engines of several runs in
one document with recomputed targets, the later run's engine of a name winning, and the
refusals (runs of other workloads, no --out); and of the MoE model's checkpoint stage."""
import json
import os

import pytest

import e2e_vllm as E


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


def test_merge_combines_runs_and_recomputes_targets(tmp_path, capsys):
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


def test_merge_refuses_other_workloads_and_a_missing_out(tmp_path, capsys):
    a = _run(tmp_path / "a.json", {"fp8_blockgemm": [4.0, 4.0]})
    b = _run(tmp_path / "b.json", {"fp8_cutlass": [4.6, 5.6]}, compile="none")
    with pytest.raises(SystemExit, match=r"--merge: \['compile'\] differ between"):
        E.main(["--merge", a, b, "--out", str(tmp_path / "m.json")])
    with pytest.raises(SystemExit):
        E.main(["--merge", a, b])
    assert "--merge needs --out" in capsys.readouterr().err


def test_merge_of_a_moe_run_compares_with_vllm_fp8(tmp_path):
    """A saved MoE run (no BF16 reference: its BF16 engine runs dummy weights) keeps vLLM's
    fp8 as the log-probability reference and the MoE targets when merged."""
    n = E.LP_PROMPT_LEN - 1
    a = _run(tmp_path / "a.json", {"fp8_blockgemm": [4.0, 6.0], "fp8_cutlass": [4.8, 6.6]},
             model={"layers": 48, "num_experts": 128})
    d = json.loads(open(a).read())
    for name, lp in (("fp8_cutlass", -1.0), ("fp8_blockgemm", -1.25)):
        d["engines"][name].update(tf_source="own", tf_logprobs=[lp] * (n + 3))
    open(a, "w").write(json.dumps(d))
    out = tmp_path / "m.json"
    assert E.main(["--merge", a, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    lp = doc["logprobs"]["fp8_blockgemm"]
    assert lp["prompt_abs_dlogprob_mean"] == pytest.approx(0.25)
    assert doc["targets"]["fp8_blockgemm vs best vLLM fp8 (need >= 1.25x at b1/b4, "
                          "1.10x at b16/b64)"] == "b1 1.20x FAIL, b4 1.10x FAIL"


def test_merge_keeps_a_renamed_run_and_compares_prompt_logprobs_across_runs(tmp_path):
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


def test_merge_renames_only_the_named_engines(tmp_path):
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


def test_moe_models_stage_writes_block_fp8_experts_and_a_bf16_config(tmp_path):
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


def test_parallel_suffixes_are_parsed_and_validated(capsys):
    """NAME@tp<N> / NAME@ep<N>: TP1 engines and their multi-GPU variants in one run; a bad
    suffix, N < 2 or @ep on a dense shape stop parse_args before anything runs."""
    for shape in ("tiny_moe", "qwen3_30b_a3b"):
        a = E.parse_args(["--shape", shape, "--configs",
                          "fp8_blockgemm@tp2,fp8_blockgemm@ep2,blockgemm@ep02,fp8_blockgemm"])
        assert a.config_list == ["fp8_blockgemm@tp2", "fp8_blockgemm@ep2", "fp8_blockgemm"]
    assert E.parse_args(["--configs", "+cutlass@tp4"]).config_list == [
        "bf16", "fp8_blockgemm", "fp8_cutlass", "fp8_cutlass@tp4"]
    assert E.parallel("fp8_blockgemm@ep2") == ("fp8_blockgemm", 2, True)
    assert E.parallel("fp8_cutlass@tp4") == ("fp8_cutlass", 4, False)
    assert E.parallel("fp8_blockgemm@tp2_seqs256") == ("fp8_blockgemm_seqs256", 2, False)
    assert E.parallel("fp8_blockgemm_nopdl") == ("fp8_blockgemm_nopdl", 1, False)
    for configs, shape, msg in (
            ("fp8_blockgemm@dp2", "tiny_moe", "unknown suffix @dp2: @tp<N> (tensor parallel) "
                                              "or @ep<N> (expert parallel)"),
            ("fp8_blockgemm@tp", "tiny_moe", "unknown suffix @tp:"),
            ("fp8_blockgemm@tp2@ep2", "tiny_moe", "unknown suffix @tp2@ep2:"),
            ("fp8_blockgemm@ep1", "tiny_moe", "@ep1 needs N >= 2"),
            ("fp8_blockgemm@tp0", "llama8b", "@tp0 needs N >= 2"),
            ("nope@tp2", "tiny_moe", "unknown config 'nope'"),
            ("@tp2", "tiny_moe", "unknown config ''"),
            ("fp8_blockgemm@ep2", "llama8b", "@ep needs a MoE --shape (qwen3_30b_a3b, tiny_moe), "
                                             "not llama8b"),
            ("bf16,fp8_cutlass@ep2", "tiny", "@ep needs a MoE --shape")):
        with pytest.raises(SystemExit):
            E.parse_args(["--shape", shape, "--configs", configs])
        assert msg in capsys.readouterr().err, configs


def test_ep2_engine_spec_and_llm_kwargs(monkeypatch):
    """The worker's spec and LLM(...) kwargs of a @ep2 engine carry tensor_parallel_size=2
    and enable_expert_parallel=True, the rest as its TP1 engine's; multicast stays off."""
    monkeypatch.setattr(E, "MODEL", E.SHAPES["qwen3_30b_a3b"])
    args = E.parse_args(["--shape", "qwen3_30b_a3b", "--configs",
                         "fp8_blockgemm,fp8_blockgemm@ep2,fp8_cutlass@tp2,bf16@tp2"])
    specs = {n: E.engine_spec(n, args, "/w", 300.0, [5, 6]) for n in args.config_list}
    spec, env = specs["fp8_blockgemm@ep2"]
    assert (spec["model"], spec["quantization"], spec["tensor_parallel_size"],
            spec["expert_parallel"], spec["dummy_weights"], spec["tf_tokens"]) == (
        "/w/fp8", "fp8_blockgemm", 2, True, False, [5, 6])
    assert spec["result"] == "/w/result_fp8_blockgemm@ep2.json"
    assert env == {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "NCCL_NVLS_ENABLE": "0",
                   "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    kw = E.llm_kwargs(json.loads(json.dumps(spec)))          # as the worker reads it
    assert kw["tensor_parallel_size"] == 2 and kw["enable_expert_parallel"] is True
    assert kw["gpu_memory_utilization"] == 0.35 and kw["quantization"] == "fp8_blockgemm"
    tp1_spec, tp1_env = specs["fp8_blockgemm"]
    assert tp1_env == {} and (tp1_spec["tensor_parallel_size"], tp1_spec["expert_parallel"]) \
        == (1, False)
    tp1 = E.llm_kwargs(tp1_spec)
    assert {k: v for k, v in kw.items()
            if k not in ("tensor_parallel_size", "enable_expert_parallel")} == tp1
    spec, env = specs["fp8_cutlass@tp2"]
    kw = E.llm_kwargs(spec)
    assert (kw["tensor_parallel_size"], kw["enable_expert_parallel"], kw["quantization"]) == \
        (2, False, "fp8")
    assert env["VLLM_USE_DEEP_GEMM"] == "0" and env["NCCL_NVLS_ENABLE"] == "0"
    kw = E.llm_kwargs(specs["bf16@tp2"][0])
    assert (kw["load_format"], kw["tensor_parallel_size"], "quantization" in kw) == \
        ("dummy", 2, False)


def test_targets_table_and_plot_with_parallel_engines(tmp_path, capsys):
    """TP1 engines meet TP1 anchors only; fp8_blockgemm@tp2 meets fp8_cutlass@tp2; @ep2
    without an @ep2 anchor is reported without a ratio; table and plot take the names."""
    a = _run(tmp_path / "a.json", {
        "bf16": [6.0, 6.4], "fp8_blockgemm": [4.0, 4.0], "fp8_cutlass": [4.8, 5.6],
        "fp8_blockgemm@tp2": [3.0, 3.2], "fp8_cutlass@tp2": [3.6, 4.0],
        "fp8_blockgemm@ep2": [3.5, 3.3]})
    out = tmp_path / "m.json"
    assert E.main(["--merge", a, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["targets"] == {
        "fp8_blockgemm vs best vLLM fp8 (need >= 1.15x)": "b1 1.20x PASS, b4 1.40x PASS",
        "fp8_blockgemm speedup vs bf16": "b1 1.50x, b4 1.60x",
        "engine start vs bf16 (need <= +30 s)": "+0.0 s PASS",
        "fp8_blockgemm@ep2 ms per output token (no @ep2 anchor)": "b1 3.50, b4 3.30",
        "fp8_blockgemm@tp2 vs best vLLM fp8@tp2 (need >= 1.15x)":
            "b1 1.20x PASS, b4 1.25x PASS"}
    assert doc["parallel_vs_tp1"]["fp8_blockgemm@tp2"] == {"error": "no log-probabilities"}
    assert (tmp_path / "m.png").stat().st_size > 0
    lines = capsys.readouterr().out.splitlines()
    row = next(ln for ln in lines if ln.startswith("fp8_blockgemm@tp2 "))
    assert "  3.00   3.20 |" in row
    assert "target fp8_blockgemm@ep2 ms per output token (no @ep2 anchor): b1 3.50, b4 3.30" \
        in lines
