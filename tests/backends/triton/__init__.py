"""Tests of fp8linear/backends/triton (see tests/backends/__init__.py)."""
