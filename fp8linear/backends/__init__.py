"""The compute backends behind fp8linear.ops: ``dispatch`` picks one per call among
``reference`` (torch, the numerics' definition), ``triton`` (any GPU) and ``sm90`` (our Hopper
CUDA kernels). Each backend owns its plans; nothing in a backend imports ``dispatch``."""
