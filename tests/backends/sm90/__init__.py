"""Tests of fp8linear/backends/sm90 (see tests/backends/__init__.py)."""
