"""Tests of fp8linear/backends, mirroring its layout (dispatch, sm90/, triton/).

A package (as are sm90/ and triton/), so that files of the same name in the subpackages
(sm90/test_plan.py, triton/test_plan.py) do not collide: pytest imports them as
``backends.sm90.test_plan`` and so on, with tests/ on sys.path, under ``pytest`` and
``python -m pytest`` alike. Siblings import each other relatively (``from . import
sanitize_gemm``); tests/ modules such as fp64_reference stay top-level imports.
"""
