"""The network profile's CPU-side pieces: how kernels are filed by kind, and the errors against the reference."""

from __future__ import annotations

import math

import pytest
import torch

from bench import network_profile


@pytest.mark.parametrize(
    ("name", "stage", "kind"),
    [
        ("triton_tem_fused__to_copy_add_flex_attention_mean_mul_9", "DiT", "attention"),
        (
            "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize256x128x64",
            "decode",
            "convolution",
        ),
        ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>", "decode", "layout transposes (cuDNN)"),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", "DiT", "matmul"),
        ("void at::native::radixSortKVInPlace<2, -1, 32, 32, long, long, unsigned int>", "DiT", "sort (NABLA mask)"),
        ("triton_poi_fused_cat_silu_54", "decode", "fused (Triton)"),
        ("Memcpy DtoH (Device -> Pageable)", "decode", "memory copy"),
    ],
)
def test_kernels_are_filed_by_what_they_do(name: str, stage: str, kind: str) -> None:
    assert network_profile.kind_of(name, stage) == kind


def test_pixel_match_and_relative_error() -> None:
    reference = torch.zeros((3, 2, 4, 4), dtype=torch.uint8)
    same = network_profile.pixel_match(reference, reference)
    assert same["psnr_db"] == float("inf") and same["equal_bytes"] == 1.0
    off = reference.clone()
    off[0, 0, 0, 0] = 10
    match = network_profile.pixel_match(off, reference)
    mse = 100 / reference.numel()
    assert match["psnr_db"] == round(10 * math.log10(255**2 / mse), 2)
    assert match["max_abs"] == 10.0
    assert network_profile.rel_error(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == pytest.approx(1.0)
