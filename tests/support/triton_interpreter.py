"""Run a script under Triton's CPU interpreter, for the kernel tests that CI runs without a GPU,
and the tolerances those scripts hold the kernels to.

TRITON_INTERPRET=1 must be set before triton is imported, hence a subprocess. The script prints
"ok" when every check in it held.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def assert_ok_in_interpreter(script: str, *args: str) -> None:
    """Run `script` with `args` as its sys.argv[1:]."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# ---- the tolerances the kernel tests share (imported by the scripts above) ----------------------


def fp32_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |got - ref| relative to the largest |ref| of its row (last dim).

    Row-relative, not element-relative: a fused RoPE or residual add sums terms as large as the row
    into a result that may be near zero, and any reordering moves such a result by a row-sized ulp.
    An all-zero row must come out exactly zero (a NaN anywhere fails: NaN compares false).
    """
    got, ref = got.float(), ref.float()
    scale = ref.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    return ((got - ref).abs() / scale).max().item()


def bf16_error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(largest |got - ref| in BF16 steps, fraction of outputs that differ at all).

    Steps (units in the last place) of |ref|, or of a thousandth of its row's largest value where
    |ref| is smaller than that: far below the row's scale, torch's own formula may round to 0 what
    the kernel keeps (GELU's negative tail), and only those tiny values are left out of the count.
    The kernels round as torch does, so few outputs differ; one that truncated would stay within a
    step but differ in about half of them.
    """
    got, ref = got.float(), ref.float()
    floor = 1e-3 * ref.abs().amax(-1, keepdim=True)
    magnitude = torch.maximum(ref.abs(), floor).clamp(min=1e-30)
    ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(magnitude)[1] - 8)  # 8 significant bits
    steps = ((got - ref).abs() / ulp).max().item()
    counted = ref.abs() >= floor
    differ = ((got != ref) & counted).sum().item() / max(1, int(counted.sum().item()))
    return steps, differ


def assert_kernel_matches(what: object, got: torch.Tensor, ref: torch.Tensor) -> None:
    """The rule the kernel tests hold a fused kernel to against the torch ops it replaces: the same
    shape and dtype; FP32 within 1e-6 of each row's scale; BF16 within one step, at most 1% of the
    outputs different (the kernels round where torch rounds)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, got.dtype, ref.dtype)
    if ref.dtype == torch.float32:
        err = fp32_error(got, ref)
        assert err <= 1e-6, (what, "fp32", err)
    else:
        steps, differ = bf16_error(got, ref)
        assert steps <= 1 and differ <= 0.01, (what, "bf16 steps", steps, "differ", differ)
