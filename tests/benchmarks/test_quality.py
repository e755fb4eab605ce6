"""benchmarks/quality.py without the model: the metrics on synthetic logits with known
answers, the token windows, and the committed result's schema. Needs neither the network nor transformers nor vLLM."""
from __future__ import annotations

import json
import math
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import quality

REPO = Path(__file__).resolve().parents[2]
RESULT = REPO / "benchmarks" / "results" / "2026-11-27_quality_smollm2_cpu.json"


# ------------------------------------------------------------------ metrics
def test_logprobs_and_argmax_from_logits_with_known_distribution():
    # logits = log p (+ any per-row constant): log_softmax gives back log p exactly
    p = torch.tensor([[0.5, 0.25, 0.125, 0.125],
                      [0.1, 0.2, 0.3, 0.4],
                      [0.7, 0.1, 0.1, 0.1],
                      [0.25, 0.25, 0.25, 0.25]])  # the last row predicts nothing
    logits = torch.log(p) + torch.tensor([[3.0], [-1.0], [0.0], [7.0]])
    ids = [2, 1, 3, 0]  # targets of positions 0..2: ids[1:] = 1, 3, 0
    lp, am = quality.target_logprobs_and_argmax(logits, ids)
    assert lp == pytest.approx([math.log(0.25), math.log(0.4), math.log(0.7)], abs=1e-6)
    assert am == [0, 3, 0]


def test_logprobs_computed_in_float32_from_bf16_logits():
    logits = torch.zeros(3, 8, dtype=torch.bfloat16)
    lp, _ = quality.target_logprobs_and_argmax(logits, [0, 1, 2])
    assert lp == pytest.approx([-math.log(8)] * 2, abs=1e-6)


def test_logits_that_do_not_match_the_tokens_are_refused():
    with pytest.raises(ValueError):
        quality.target_logprobs_and_argmax(torch.zeros(4, 5), [0, 1, 2])


def test_uniform_logits_have_the_vocabulary_size_as_perplexity():
    vocab = 50
    ids = [i % vocab for i in range(65)]
    lp, _ = quality.target_logprobs_and_argmax(torch.zeros(65, vocab), ids)
    assert len(lp) == 64
    assert quality.perplexity(lp) == pytest.approx(vocab, rel=1e-6)


def test_perplexity_is_exp_of_the_mean_nll():
    assert quality.perplexity([-math.log(4)] * 7) == pytest.approx(4.0)
    # exp((log 2 + log 8) / 2) = sqrt(16)
    assert quality.perplexity([-math.log(2), -math.log(8)]) == pytest.approx(4.0)
    assert quality.perplexity([0.0]) == 1.0
    with pytest.raises(ValueError):
        quality.perplexity([])


def test_top1_agreement():
    assert quality.top1_agreement([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    assert quality.top1_agreement([5], [5]) == 1.0
    assert quality.top1_agreement([1, 2], [3, 4]) == 0.0
    with pytest.raises(ValueError):
        quality.top1_agreement([1, 2], [1])


def test_mean_abs_dlogprob():
    assert quality.mean_abs_dlogprob([-1.0, -2.0, -3.0], [-1.5, -2.0, -2.0]) == \
        pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert quality.mean_abs_dlogprob([-1.0], [-1.0]) == 0.0
    with pytest.raises(ValueError):
        quality.mean_abs_dlogprob([-1.0], [])


def test_compare_against_a_reference_run():
    # two "models" on the same 4-token window: the second shifts one position's mass
    ids = [0, 1, 2, 3]
    ref_logits = torch.log(torch.tensor([[0.6, 0.2, 0.1, 0.1],
                                         [0.1, 0.1, 0.7, 0.1],
                                         [0.1, 0.1, 0.1, 0.7],
                                         [0.25, 0.25, 0.25, 0.25]]))
    new_logits = ref_logits.clone()
    new_logits[1] = torch.log(torch.tensor([0.1, 0.5, 0.3, 0.1]))  # argmax 2 -> 1
    ref = dict(zip(("logprobs", "argmax"), quality.target_logprobs_and_argmax(ref_logits, ids)))
    new = dict(zip(("logprobs", "argmax"), quality.target_logprobs_and_argmax(new_logits, ids)))
    c = quality.compare(new, ref)
    assert c["top1_agree"] == pytest.approx(2 / 3, abs=1e-5)
    # only position 1 (target 2) changed: |log 0.3 - log 0.7| / 3
    assert c["mean_abs_dlogprob"] == pytest.approx(abs(math.log(0.3) - math.log(0.7)) / 3,
                                                   abs=1e-5)
    assert quality.compare(ref, ref) == {"top1_agree": 1.0, "mean_abs_dlogprob": 0.0}


Logprob = namedtuple("Logprob", "logprob rank decoded_token")


def test_vllm_prompt_logprobs_give_target_logprob_and_rank1_token():
    prompt = [7, 3, 9, 4]
    plp = [None,
           {3: Logprob(-0.1, 1, None)},                          # target is the top token
           {9: Logprob(-2.5, 4, None), 5: Logprob(-0.3, 1, None)},
           {4: Logprob(-1.0, 2, None), 8: Logprob(-0.9, 1, None)}]
    lp, top = quality.vllm_prompt_stats(plp, prompt)
    assert lp == [-0.1, -2.5, -1.0]
    assert top == [3, 5, 8]
    assert quality.perplexity(lp) == pytest.approx(math.exp((0.1 + 2.5 + 1.0) / 3))


def _stats(logprobs, argmax):
    return {"logprobs": logprobs, "argmax": argmax, "load_s": 1.0}


def test_rows_compare_with_transformers_bf16_and_keep_errors(tmp_path):
    lp2, lp4 = [-math.log(2)] * 4, [-math.log(4)] * 4
    stats = {("transformers", "bf16"): _stats(lp2, [1, 2, 3, 4]),
             ("vllm", "bf16"): _stats(lp2, [1, 2, 3, 5]),
             ("vllm", "fp8_online"): _stats(lp4, [1, 2, 3, 5]),
             ("vllm", "vllm_fp8_checkpoint"): {"error": "ValueError: 576 % 128",
                                               "traceback_tail": "..."}}
    rows = [{"key": ("transformers", "bf16"), "engine": "transformers", "model": "bf16",
             "quantization": None},
            {"key": ("vllm", "bf16"), "engine": "vllm", "model": "bf16", "quantization": None},
            {"key": ("vllm", "fp8_online"), "engine": "vllm", "model": "fp8_online",
             "quantization": "fp8_blockgemm"},
            {"key": ("vllm", "vllm_fp8_checkpoint"), "engine": "vllm",
             "model": "fp8_checkpoint", "quantization": "fp8"}]
    out = quality.build_rows(rows, stats)
    assert [r["ppl"] for r in out] == [2.0, 2.0, 4.0, None]
    assert out[0]["top1_agree"] == 1.0 and out[0]["reference"] == "transformers/bf16"
    assert out[1]["top1_agree"] == 0.75
    assert out[2]["mean_abs_dlogprob"] == pytest.approx(math.log(2), abs=1e-5)
    assert out[2]["vs_engine_bf16"] == {"top1_agree": 1.0,
                                        "mean_abs_dlogprob": pytest.approx(math.log(2),
                                                                           abs=1e-5)}
    assert "note" in out[2]
    assert out[3]["error"].startswith("ValueError") and out[3]["tokens"] == 0
    assert all("key" not in r for r in out)
    assert out[0]["load_s"] == 1.0

    # without transformers (the GPU run): vLLM's BF16 run is the reference
    del stats[("transformers", "bf16")]
    out = quality.build_rows(rows[1:], stats)
    assert out[0]["reference"] == "vllm/bf16" and out[0]["top1_agree"] == 1.0
    assert "vs_engine_bf16" not in out[1]

    header = {"model": {"name": "m"}, "scored_tokens": 4, "windows": 1, "window": 5,
              "device": "cpu"}
    res = quality.write_result(header, rows[1:], stats, tmp_path / "r.json", final=False)
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["header"]["complete"] is False and len(on_disk["rows"]) == 3
    assert on_disk == json.loads(json.dumps(res))
    assert "error:" in quality.format_table(res) and "4.000" in quality.format_table(res)


# ------------------------------------------------------------------ text windows
class CharTokenizer:
    """One token per character (what token_windows needs of a tokenizer)."""

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}


def test_a_gpu_quality_run_refuses_the_reference_paths(monkeypatch):
    import fp8linear.backends.reference as ref
    import fp8linear.moe as moe
    for mod, attr in ((ref, "gemm"), (ref, "linear"), (moe, "moe_reference")):
        monkeypatch.setattr(mod, attr, getattr(mod, attr))  # restored after the test
    patched = quality._forbid_reference_backend()
    assert patched == ["fp8linear.backends.reference.gemm",
                       "fp8linear.backends.reference.linear", "fp8linear.moe.moe_reference"]

    class OnGpu:
        is_cuda = True
    with pytest.raises(RuntimeError, match="reference moe_reference ran on a GPU tensor"):
        moe.moe_reference(OnGpu(), None, None, None, None, None, None)
    with pytest.raises(RuntimeError, match="reference gemm ran on a GPU tensor"):
        ref.gemm(OnGpu(), None, None, None, None, None)


def test_text_sources_are_shipped():
    for name in quality.TEXT_SOURCES:
        assert (quality.DATA / name).stat().st_size > 1000


def test_token_windows_cut_and_split(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 10)
    (tmp_path / "b.py").write_text("y" * 7)
    windows, info = quality.token_windows(CharTokenizer(), ("a.txt", "b.py"), window=4,
                                          max_tokens=100, data_dir=tmp_path)
    # 17 tokens -> 4 + 4 + 4 + 4 + 1: the 1-token tail scores nothing and is dropped
    assert [len(w) for w in windows] == [4, 4, 4, 4]
    assert windows[2] == [ord("x")] * 2 + [ord("y")] * 2
    assert [s["tokens"] for s in info] == [10, 7]
    assert [s["tokens_used"] for s in info] == [10, 6]
    windows, info = quality.token_windows(CharTokenizer(), ("a.txt", "b.py"), window=4,
                                          max_tokens=6, data_dir=tmp_path)
    assert [len(w) for w in windows] == [4, 2]
    assert [s["tokens_used"] for s in info] == [6, 0]
    assert len(info[0]["sha256"]) == 64
    with pytest.raises(ValueError):
        quality.token_windows(CharTokenizer(), ("a.txt",), window=4, max_tokens=1,
                              data_dir=tmp_path)


def test_json_tokenizer_reads_a_checkpoints_tokenizer_json(tmp_path):
    import tokenizers   # (transformers' dependency, in the dev extra: missing, this fails)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    jt = quality.JsonTokenizer(tmp_path)
    assert jt("hello world again", add_special_tokens=False)["input_ids"] == [1, 2, 0]
    with pytest.raises(FileNotFoundError):
        quality.JsonTokenizer(tmp_path / "nowhere")


# ------------------------------------------------------------------ the committed result
def test_committed_cpu_result_has_the_full_table():
    d = json.loads(RESULT.read_text())
    h = d["header"]
    for key in ("date", "device", "torch", "transformers", "vllm", "command", "model",
                "text_sources", "tokens", "scored_tokens"):
        assert h.get(key), key
    assert h["scored_tokens"] >= 9000
    rows = {(r["engine"], r["model"], r.get("quantization")): r for r in d["rows"]}
    for key in [("transformers", m, q) for m, q in (("bf16", None), ("fp32", None),
                                                    ("fp8_checkpoint", "fp8linear"))] + \
               [("vllm", m, q) for m, q in (("bf16", None), ("fp8_checkpoint", "fp8_blockgemm"),
                                             ("fp8_online", "fp8_blockgemm"))]:
        r = rows[key]
        assert r["tokens"] == h["scored_tokens"], key
        assert 5 < r["ppl"] < 100, key
        assert 0.5 < r["top1_agree"] <= 1.0 and 0 <= r["mean_abs_dlogprob"] < 1, key
    # block FP8 costs a little perplexity, never a lot
    bf16 = rows[("transformers", "bf16", None)]["ppl"]
    fp8 = rows[("transformers", "fp8_checkpoint", "fp8linear")]["ppl"]
    assert bf16 < fp8 < 1.1 * bf16
