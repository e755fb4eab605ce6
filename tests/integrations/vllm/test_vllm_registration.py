"""The plugin is found through its ``vllm.general_plugins`` entry point in a fresh process,
with no user code: vLLM's own plugin loader registers ``fp8_blockgemm``."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import vllm_env

PROBE = """
import json
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
before = "fp8_blockgemm" in QUANTIZATION_METHODS
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.layers.quantization import get_quantization_config
cls = get_quantization_config("fp8_blockgemm")
print("PROBE " + json.dumps({"before": before, "after": "fp8_blockgemm" in QUANTIZATION_METHODS,
                            "cls": cls.__module__ + "." + cls.__name__,
                            "name": cls.get_name()}))
"""


def test_entry_point_registers_the_method_in_a_fresh_process(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROBE], env=vllm_env(tmp_path),
                          capture_output=True, text=True, timeout=180)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    got = json.loads(line[0][len("PROBE "):])
    assert got == {"before": False, "after": True, "name": "fp8_blockgemm",
                   "cls": "fp8linear_vllm.config.Fp8BlockGemmConfig"}
