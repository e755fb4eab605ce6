"""fp8linear/backends/dispatch.py on the CPU: the backend for a call by device, GPU and shape,
and FP8LINEAR_BACKEND (validated, ignored for CPU tensors). CUDA is faked where needed."""
from __future__ import annotations

import pytest
import torch

from expect import raises_exactly
from fp8linear.backends import dispatch, reference
from fp8linear.backends.sm90 import build

CUDA0 = torch.device("cuda", 0)


def test_cpu_tensors_use_the_reference(monkeypatch):
    monkeypatch.delenv("FP8LINEAR_BACKEND", raising=False)
    assert dispatch.backend_for(torch.device("cpu"), 4, 256, 256) is reference


@pytest.mark.parametrize("forced", ["triton", "sm90"])
def test_forced_gpu_backend_is_ignored_for_cpu_tensors(monkeypatch, forced):
    monkeypatch.setenv("FP8LINEAR_BACKEND", forced)
    with pytest.warns(UserWarning, match=f"^FP8LINEAR_BACKEND={forced} ignored for a cpu "
                                         f"tensor: using the torch reference$"):
        assert dispatch.backend_for(torch.device("cpu"), 4, 256, 256) is reference


def test_forced_backend_env(monkeypatch):
    monkeypatch.delenv("FP8LINEAR_BACKEND", raising=False)
    assert dispatch.forced_backend() is None
    monkeypatch.setenv("FP8LINEAR_BACKEND", "")           # empty: unset
    assert dispatch.forced_backend() is None
    for name in ("reference", "triton", "sm90"):
        monkeypatch.setenv("FP8LINEAR_BACKEND", name)
        assert dispatch.forced_backend() == name


@pytest.mark.parametrize("bad", ["cuda", "SM90", "torch"])
def test_backend_env_is_validated(monkeypatch, bad):
    monkeypatch.setenv("FP8LINEAR_BACKEND", bad)
    msg = f"FP8LINEAR_BACKEND='{bad}': expected one of reference, triton, sm90"
    with raises_exactly(ValueError, msg):
        dispatch.backend_for(torch.device("cpu"), 4, 256, 256)


def test_forced_sm90_on_another_gpu_fails_before_launch(monkeypatch):
    monkeypatch.setenv("FP8LINEAR_BACKEND", "sm90")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 9))
    dispatch._check_sm90_device.cache_clear()
    try:
        with pytest.raises(build.BuildError, match=r"need an sm_90 \(Hopper\) GPU, this one "
                                                   r"is sm_89"):
            dispatch.backend_for(CUDA0, 1, 128, 128)
        with pytest.raises(build.BuildError, match=r"need an sm_90 \(Hopper\) GPU, this one "
                                                   r"is sm_89"):
            dispatch.moe_backend(CUDA0, 2048, 768, True)
    finally:
        dispatch._check_sm90_device.cache_clear()


@pytest.fixture
def fake_hopper(monkeypatch):
    """A CUDA device whose default backend is sm90; backends by name (no Triton needed)."""
    monkeypatch.delenv("FP8LINEAR_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "_cuda_default", lambda index: "sm90")
    monkeypatch.setattr(dispatch, "_check_sm90_device", lambda index: None)
    monkeypatch.setattr(dispatch, "_module", lambda name: name)
    return monkeypatch


@pytest.mark.parametrize("n,k,want", [(128, 256, "sm90"), (100, 256, "triton"),
                                      (128, 200, "triton"), (8, 16, "sm90")])
def test_shapes_tma_cannot_take_go_to_triton(fake_hopper, n, k, want):
    # TMA needs 16-byte row strides (K % 16, N % 8): other shapes take the Triton path
    assert dispatch.backend_for(CUDA0, 4, n, k) == want


def test_forced_sm90_rejects_shapes_tma_cannot_take(fake_hopper):
    fake_hopper.setenv("FP8LINEAR_BACKEND", "sm90")
    assert dispatch.backend_for(CUDA0, 4, 128, 256) == "sm90"
    msg = ("the sm90 backend needs K % 16 == 0 and N % 8 == 0 (TMA needs 16-byte row strides); "
           "got N=100, K=256. Unset FP8LINEAR_BACKEND to use the Triton path.")
    with raises_exactly(ValueError, msg):
        dispatch.backend_for(CUDA0, 4, 100, 256)
    fake_hopper.setenv("FP8LINEAR_BACKEND", "triton")
    assert dispatch.backend_for(CUDA0, 4, 128, 256) == "triton"


def test_moe_backend(monkeypatch):
    monkeypatch.delenv("FP8LINEAR_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "_require_sm90", lambda device: None)  # (a Hopper GPU)
    assert dispatch.moe_backend(torch.device("cpu"), 2048, 768, True) == "reference"
    monkeypatch.setenv("FP8LINEAR_BACKEND", "triton")  # (no Triton MoE: the reference)
    assert dispatch.moe_backend(CUDA0, 2048, 768, True) == "reference"
    monkeypatch.setenv("FP8LINEAR_BACKEND", "sm90")
    assert dispatch.moe_backend(CUDA0, 2048, 768, True) == "sm90"
    need = ("the sm90 MoE kernels need hidden % 16 == 0, an expert intermediate size % 128 == 0 "
            "and 128x128 weight scales; got hidden 2048, ")
    with raises_exactly(ValueError, need + "intermediate 96"):
        dispatch.moe_backend(CUDA0, 2048, 96, True)
    with raises_exactly(ValueError, need + "intermediate 768, per-row scales"):
        dispatch.moe_backend(CUDA0, 2048, 768, False)
