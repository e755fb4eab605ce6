"""Fixtures of the checkpoint tests: a saved quantized model and a converted checkpoint."""
import pytest

import tiny_checkpoints as tiny
from checkpoint_helpers import quantized_tiny
from fp8linear.checkpoint import (quantize_checkpoint, save_fp8_checkpoint,
                                  validate_quantized_checkpoint)


@pytest.fixture
def saved(tmp_path):
    save_fp8_checkpoint(quantized_tiny(), tmp_path, max_shard_bytes=200_000)
    return tmp_path


@pytest.fixture
def converted(tmp_path):
    tiny.write_checkpoint(tmp_path / "in")
    quantize_checkpoint(tmp_path / "in", tmp_path / "out", progress=False)
    validate_quantized_checkpoint(tmp_path / "out")
    return tmp_path / "out"

