"""fp8linear.from_pretrained: block-FP8 checkpoints into tiny transformers models of three
architectures (a Llama decoder, a BERT encoder, a Qwen2 decoder with tied embeddings), on
the CPU, compared with the original model."""
import copy
import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp64_reference as ref
import fp8linear
from fp8linear import FP8Linear, load_fp8_checkpoint, quantize_model
from fp8linear.checkpoint import INDEX_NAME, CheckpointError, quantize_checkpoint
from fp8linear.experts import FP8Experts
from tiny_hf_moe import mixtral, model_of, qwen3_moe

import transformers  # noqa: E402  (the dev extra's: missing, these tests fail, never skip)


def llama():
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=320, hidden_size=192, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=False)


def qwen2_tied():
    return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        vocab_size=320, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True)


def bert():
    return transformers.BertModel, transformers.BertConfig(
        vocab_size=300, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=384, max_position_embeddings=64)


def save_original(cls, cfg, path):
    """A randomly initialised bf16 model, saved the transformers way; weights wider than the
    0.02 init so that the comparison is not noise."""
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                wide = p.shape[0] == cfg.vocab_size or "embeddings" in name
                p.normal_(0, 1.0 if wide else p.shape[1] ** -0.5)
    model.to(torch.bfloat16).save_pretrained(path)


def output(result):
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def fp8_weights(path):
    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    return {n[:-len(".weight")] for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}


@pytest.mark.parametrize("arch,max_err,min_top1", [(llama, 0.15, 0.75),
                                                   (qwen2_tied, 0.1, 0.9),
                                                   (bert, 0.1, None)])
def test_from_pretrained_runs_fp8linear_and_matches_the_original(tmp_path, arch, max_err,
                                                                  min_top1):
    cls, cfg = arch()
    save_original(cls, cfg, tmp_path / "in")
    quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    model = fp8linear.from_pretrained(cls, tmp_path / "out")
    original = cls.from_pretrained(tmp_path / "in", dtype=torch.bfloat16).eval()

    # the layers whose weight the checkpoint holds in fp8 run FP8Linear; the rest stay
    layers = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert layers == fp8_weights(tmp_path / "out") and len(layers) >= 12
    assert not any(isinstance(m, FP8Linear) for n, m in model.named_modules()
                   if "lm_head" in n or "embed" in n)
    if cfg.tie_word_embeddings and hasattr(model, "lm_head"):
        assert model.lm_head.weight is model.get_input_embeddings().weight
    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = output(original(ids)), output(model(ids))
        # the checkpoint route gives exactly the model quantized in memory
        in_memory = quantize_model(copy.deepcopy(original), skip="lm_head")
        assert torch.equal(got, output(in_memory(ids)))
    # FP8's error, and not zero: an unquantized model would fail the lower bound
    assert 0.02 <= ref.rel_err(got, want) <= max_err
    if min_top1 is not None:
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= min_top1


@pytest.mark.parametrize("arch,expert", [
    (qwen3_moe, "model.layers.1.mlp.experts.3.{}"),
    # (transformers renames Mixtral's block_sparse_moe to mlp while loading, back while saving)
    (mixtral, "model.layers.1.block_sparse_moe.experts.3.{}")])
def test_moe_checkpoints_load_per_expert_into_fp8_experts(tmp_path, arch, expert):
    """transformers (>= 5) saves a MoE model's fused experts per expert; `fp8linear quantize`
    quantizes each expert's projections, from_pretrained runs them as FP8Experts, and
    save_fp8_checkpoint writes the same per-expert tensors back, under the same names."""
    model, cfg = model_of(arch)
    cls = type(model)
    model.save_pretrained(tmp_path / "in")
    original = cls.from_pretrained(tmp_path / "in", dtype=torch.bfloat16).eval()
    quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    fp8 = fp8_weights(tmp_path / "out")
    names = {qwen3_moe: ("gate_proj", "up_proj", "down_proj"), mixtral: ("w1", "w3", "w2")}
    assert {expert.format(p) for p in names[arch]} <= fp8
    loaded = fp8linear.from_pretrained(cls, tmp_path / "out")
    assert all(isinstance(layer.mlp.experts, FP8Experts) for layer in loaded.model.layers)
    in_memory = quantize_model(copy.deepcopy(original))
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = in_memory(ids).logits
        assert torch.equal(loaded(ids).logits, want)  # the checkpoint route: the same model
        assert 0.02 <= ref.rel_err(want, original(ids).logits) <= 0.15
    fp8linear.save_fp8_checkpoint(in_memory, tmp_path / "saved")
    assert fp8_weights(tmp_path / "saved") == fp8
    again = fp8linear.from_pretrained(cls, tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)


def test_deepseek_qwen3_layout_bf16_scales_no_index(tmp_path):
    # Qwen3-FP8 ships bf16 weight_scale_inv; small checkpoints come as one file, no index
    cls, cfg = qwen2_tied()
    save_original(cls, cfg, tmp_path / "in")
    quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    out = tmp_path / "out"
    tensors = load_file(str(out / "model.safetensors"))
    tensors = {n: t.to(torch.bfloat16) if n.endswith("_scale_inv") else t
               for n, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / INDEX_NAME).unlink()
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                     "quant_method": "fp8", "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(config))
    model = fp8linear.from_pretrained(transformers.AutoModelForCausalLM, out,
                                      dtype=torch.float32)
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, FP8Linear) and layer.weight_scale_inv.dtype == torch.float32
    assert model.model.norm.weight.dtype == torch.float32
    original = cls.from_pretrained(tmp_path / "in", dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = original(ids).logits, model(ids).logits
    assert 0.02 <= ref.rel_err(got, want) <= 0.1


def test_bert_checkpoint_with_position_ids(tmp_path):
    # older BERT checkpoints hold embeddings.position_ids, a non-persistent buffer today:
    # loading used to fail in strict mode with a hint about quantize_model's skip list
    cls, cfg = bert()
    save_original(cls, cfg, tmp_path / "in")
    tensors = load_file(str(tmp_path / "in" / "model.safetensors"))
    tensors["embeddings.position_ids"] = torch.arange(64)[None]
    save_file(tensors, str(tmp_path / "in" / "model.safetensors"))
    quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    model = fp8linear.from_pretrained(cls, tmp_path / "out")
    assert torch.equal(model.embeddings.position_ids, torch.arange(64)[None])
    plain = quantize_model(cls(cfg).to(torch.bfloat16), skip=())
    load_fp8_checkpoint(plain, tmp_path / "out")  # the path: strict, no error
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        assert torch.equal(output(plain.eval()(ids)), output(model(ids)))


def test_from_pretrained_errors(tmp_path, monkeypatch):
    cls, cfg = llama()
    save_original(cls, cfg, tmp_path / "in")
    with pytest.raises(CheckpointError) as e:
        fp8linear.from_pretrained(cls, tmp_path / "in")
    assert str(e.value) == (
        f"{tmp_path / 'in' / 'config.json'} has no quantization_config: not a block-FP8 "
        f"checkpoint (convert it with `fp8linear quantize`, or load it with transformers and "
        f"run fp8linear.quantize_model)")
    quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    config_path = tmp_path / "out" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["weight_block_size"] = [1, 128]
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        fp8linear.from_pretrained(cls, tmp_path / "out")
    assert str(e.value) == (
        f"{config_path}: quantization_config {config['quantization_config']} is not block "
        f"FP8: expected quant_method 'fp8', weight_block_size [128, 128], fmt 'e4m3' and "
        f"activation_scheme 'dynamic'")
    config_path.unlink()
    with pytest.raises(CheckpointError) as e:
        fp8linear.from_pretrained(cls, tmp_path / "out")
    assert str(e.value) == f"{config_path} is missing: from_pretrained builds the model from it"
    quantize_checkpoint(tmp_path / "in", tmp_path / "ok", progress=False)
    with pytest.raises(TypeError) as e:
        fp8linear.from_pretrained(torch.nn.Linear, tmp_path / "ok")
    assert str(e.value) == ("from_pretrained expects a transformers model class or Auto "
                            "class, got <class 'torch.nn.modules.linear.Linear'>")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError) as e:
        fp8linear.from_pretrained(cls, tmp_path / "out")
    assert str(e.value) == ("fp8linear.from_pretrained needs transformers: pip install "
                            "transformers")
