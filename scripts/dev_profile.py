"""A few launches of each sm90 kernel, for ncu (see benchmarks/NOTES.md)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8linear  # noqa: E402
from dev_check_sm90 import build_ext  # noqa: E402

build_ext()

m, n, k = (int(v) for v in sys.argv[1:4])
w, ws = fp8linear.quantize_weight(torch.randn(n, k, device="cuda"))
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    fp8linear.fp8_linear(x, w, ws)
torch.cuda.synchronize()
