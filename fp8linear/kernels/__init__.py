"""Backends behind fp8linear.ops: reference (torch), triton (any GPU), sm90 (Hopper CUDA)."""
