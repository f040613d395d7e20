"""What `dtype = auto` picks on the CPU: BF16 only where the CPU has BF16 dot products and no cap
holds the kernels below them, float32 elsewhere; the reason names which."""

import pytest
import torch

from rekv_core import cpu_bf16
from rekv_core.cpu_bf16 import Bf16Support, cpu_flags, native
from rekv_core.settings import RuntimeSettings

EPYC_GENOA = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
ROME = frozenset({"avx2", "fma", "sse4_2"})


def test_the_flags_are_read_from_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "absent") == frozenset()
    (tmp_path / "noflags").write_text("processor\t: 0\n")
    assert cpu_flags(tmp_path / "noflags") == frozenset()


def test_native_bf16_needs_the_instruction():
    assert native(EPYC_GENOA, {}) == Bf16Support(True, "avx512_bf16")
    assert native(SAPPHIRE_RAPIDS, {}) == Bf16Support(True, "amx_bf16")
    got = native(ROME, {})
    assert not got.native and "no BF16 dot-product instructions" in got.reason


@pytest.mark.parametrize("environ,ok", [
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, False), ({"ONEDNN_MAX_CPU_ISA": "avx512_core_vnni"}, False),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True), ({"ONEDNN_MAX_CPU_ISA": "all"}, True),
    ({"ATEN_CPU_CAPABILITY": "avx2"}, False), ({"ATEN_CPU_CAPABILITY": "default"}, False),
    ({"ATEN_CPU_CAPABILITY": "avx512"}, True),
    ({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
])
def test_a_cap_on_the_kernels_instruction_set_holds_bf16_back(environ, ok):
    got = native(EPYC_GENOA, environ)
    assert got.native is ok
    if not ok:
        name = "ONEDNN_MAX_CPU_ISA" if "ONEDNN_MAX_CPU_ISA" in environ else "ATEN_CPU_CAPABILITY"
        assert got.reason.startswith(f"avx512_bf16, but {name}=")


def test_auto_picks_bf16_only_on_a_native_cpu_and_says_why(monkeypatch):
    monkeypatch.setattr(cpu_bf16, "native", lambda: Bf16Support(True, "amx_bf16"))
    assert RuntimeSettings().dtype_choice() == (
        torch.bfloat16, "auto: native BF16 on this CPU (amx_bf16)")
    assert RuntimeSettings().torch_dtype == torch.bfloat16
    monkeypatch.setattr(cpu_bf16, "native", lambda: Bf16Support(False, "no BF16 dot-product"))
    assert RuntimeSettings().dtype_choice() == (torch.float32, "auto: no BF16 dot-product")
    assert RuntimeSettings(dtype="bfloat16").dtype_choice() == (torch.bfloat16, "set")
    assert RuntimeSettings(dtype="float32").dtype_choice() == (torch.float32, "set")
    assert RuntimeSettings(device="cuda").dtype_choice() == (torch.bfloat16, "auto: CUDA")
