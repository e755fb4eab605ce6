"""A few launches of one sm90 path, for ncu: dev_profile.py M N K [linear|gemm]."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8linear  # noqa: E402
from dev_check_sm90 import build_ext  # noqa: E402

build_ext()
m, n, k = (int(v) for v in sys.argv[1:4])
mode = sys.argv[4] if len(sys.argv) > 4 else "linear"
w, ws = fp8linear.quantize_weight(torch.randn(n, k, device="cuda"))
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
xq, xs = fp8linear.quantize_activation(x)
for _ in range(3):
    if mode == "linear":
        fp8linear.fp8_linear(x, w, ws)
    else:
        fp8linear.block_fp8_gemm(xq, xs, w, ws)
torch.cuda.synchronize()
