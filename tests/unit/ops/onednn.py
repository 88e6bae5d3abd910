"""What the emulated AVX-512 kernels (``avx512_emulated``) cannot stand in for: the cpu
backend hands rows past the skinny kernel to oneDNN's bf16 matmul, which checks the CPU itself
for AVX-512 BW/VL/DQ (or AVX-NE-CONVERT)."""

import pytest
import torch


def skip_without_onednn_bf16() -> None:
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN's bf16 matmul needs AVX-512 BW/VL/DQ in this CPU: the emulated "
                    "AVX-512 kernels run only the rows the skinny kernel takes")
