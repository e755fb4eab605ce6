"""fp8linear.checkpoint.info: what `fp8linear info` reports, from headers only."""
import tiny_checkpoints as tiny
from fp8linear.checkpoint import checkpoint_info, quantization_config


def test_checkpoint_info(converted):
    info = checkpoint_info(converted)
    assert info["quantization_config"]["weight_block_size"] == [128, 128]
    assert info["scale_fmt"] == "fp32"
    assert info["quantized_tensors"] == info["scale_tensors"] == len(tiny.LINEAR_WEIGHTS)
    assert info["unquantized_2d_weights"] == ["model.embed_tokens.weight",
                                              "model.layers.1.mlp.gate.weight"]
    assert info["fp8_without_scale"] == []
    assert info["bytes_by_dtype"]["F8_E4M3"] == info["quantized_params"]
    assert info["total_bytes"] == sum(info["bytes_by_dtype"].values())
    assert info["quantization_config"] == quantization_config(
        ignored_layers=["model.layers.1.mlp.gate"])
