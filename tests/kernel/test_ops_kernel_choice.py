"""How `ops` turns KDTREE_KERNEL into a kernel configuration per GPU (CPU: the GPU's capability
and the library are stand-ins; the GPU tests check the real thing on the H200)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kdtree_backend.kernel import abi, ops  # noqa: E402


class _FakeLib:
    """Answers kdtree_verify_plan like a library built with or without the Hopper kernel."""

    def __init__(self, has_hopper: bool):
        self.has_hopper = has_hopper
        self.plan_calls = 0

    def kdtree_verify_plan(self, batch, heads, max_qo_len, num_sms, config, plan):
        self.plan_calls += 1
        return 0 if (config != abi.CONFIG_HOPPER or self.has_hopper) else 5


@pytest.fixture
def gpu(monkeypatch):
    caps = {0: (9, 0), 1: (12, 0)}
    monkeypatch.setattr(ops.torch.cuda, "get_device_capability", lambda i: caps[i])
    monkeypatch.setattr(ops, "_resolved", {})
    monkeypatch.delenv("KDTREE_KERNEL", raising=False)
    return caps


def test_auto_is_hopper_on_9_0_and_portable_elsewhere(gpu):
    lib = _FakeLib(has_hopper=True)
    assert ops._kernel_config(lib, 0) == abi.CONFIG_HOPPER
    assert ops._kernel_config(lib, 1) == abi.CONFIG_PORTABLE


def test_auto_without_the_hopper_kernel_is_portable(gpu):
    assert ops._kernel_config(_FakeLib(has_hopper=False), 0) == abi.CONFIG_PORTABLE


def test_forced_portable_on_hopper(gpu, monkeypatch):
    monkeypatch.setenv("KDTREE_KERNEL", "portable")
    assert ops._kernel_config(_FakeLib(has_hopper=True), 0) == abi.CONFIG_PORTABLE


def test_forced_hopper_elsewhere_is_an_error_naming_the_gpu_and_fix(gpu, monkeypatch):
    monkeypatch.setenv("KDTREE_KERNEL", "hopper")
    with pytest.raises(ops.KdtreeLibraryError, match=r"GPU 1: .*12\.0.*Fix"):
        ops._kernel_config(_FakeLib(has_hopper=True), 1)


def test_bad_value_is_an_input_error(gpu, monkeypatch):
    monkeypatch.setenv("KDTREE_KERNEL", "sm90")
    with pytest.raises(ops.KernelInputError, match="KDTREE_KERNEL"):
        ops._kernel_config(_FakeLib(has_hopper=True), 0)


def test_resolution_is_cached_per_gpu_and_choice(gpu, monkeypatch):
    lib = _FakeLib(has_hopper=True)
    for _ in range(3):
        ops._kernel_config(lib, 0)
    assert lib.plan_calls == 1
    monkeypatch.setenv("KDTREE_KERNEL", "portable")  # a new choice is resolved anew
    assert ops._kernel_config(lib, 0) == abi.CONFIG_PORTABLE
