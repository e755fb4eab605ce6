"""ncu target: our large-M GEMM (config from FP8LINEAR_SM90_GEMM_CONFIG or the heuristic) and
DeepGEMM's, same data, two launches each: dev_profile_dg.py M N K. FP8LINEAR_DEV_SO=<glob> runs
that DEV_NAMESPACE build of ours instead (as dev_variants.py does); DG=0 leaves DeepGEMM out."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_gemm as B  # noqa: E402

if os.environ.get("FP8LINEAR_DEV_SO"):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import dev_variants  # noqa: E402
    dev_variants.use_build({"FP8LINEAR_DEV_SO": os.environ["FP8LINEAR_DEV_SO"]})

m, n, k = (int(v) for v in sys.argv[1:4])
methods = ["fp8linear"] + (["deepgemm"] if os.environ.get("DG", "1") != "0" else [])
libs = B.Libs(methods, probe_cublas=False)
sd = B.ShapeData(n, k, 1, 0, seed=1)
md = B.MData(sd, m, libs, seed=2)
for meth in methods:
    f = B.make_launch(meth, sd, md, libs)
    for _ in range(2):
        f(0)
torch.cuda.synchronize()
