"""Whether this CPU computes BF16 dot products natively: what `dtype = auto` picks on the CPU.

BF16 halves the weight and KV bytes a CPU reads, but it is fast only where the CPU has BF16 dot
product instructions (AVX-512 BF16's `vdpbf16ps`, or AMX's BF16 tiles): oneDNN's and torch's
BF16 kernels use them there, and elsewhere emulate BF16 through float32 conversions, slower than
float32 itself. So `native()` reads the CPU's flags (`/proc/cpuinfo`) and the caps a user may
have set on the kernels' instruction set (`ONEDNN_MAX_CPU_ISA` for oneDNN's GEMMs and
`ATEN_CPU_CAPABILITY` for torch's own kernels, as `make test-isa` does): BF16 is native only when
the CPU has one of those instructions and neither cap holds the kernels below it.

`native(flags, environ)` returns a `Bf16Support`: `native` and `reason` (the instruction found,
or why not), what the startup log and the `rekv_compute_info` metric show.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# the instructions, in the flag names Linux gives them, best first
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# oneDNN's instruction-set caps (`ONEDNN_MAX_CPU_ISA`) at or above AVX-512 BF16; any other cap
# (SSE41 … AVX512_CORE_VNNI, AVX2_VNNI…) holds its GEMMs below it
_ONEDNN_BF16_CAPS = {"ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
                     "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX",
                     "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2"}
# torch's kernel levels on x86 (`ATEN_CPU_CAPABILITY`: default, avx2, avx512) that use AVX-512
_ATEN_BF16_LEVELS = {"avx512"}


@dataclass(frozen=True)
class Bf16Support:
    native: bool
    reason: str  # the instruction found ("avx512_bf16"), or why BF16 is not native


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags; empty where there is no /proc/cpuinfo."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def native(flags: frozenset[str] | None = None,
           environ: Mapping[str, str] | None = None) -> Bf16Support:
    """BF16 support on this CPU (or on one with `flags`, under `environ`'s caps)."""
    flags = cpu_flags() if flags is None else flags
    environ = os.environ if environ is None else environ
    found = next((flag for flag in BF16_FLAGS if flag in flags), None)
    if found is None:
        return Bf16Support(False, "no BF16 dot-product instructions (avx512_bf16, amx_bf16)")
    onednn = environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if onednn and onednn not in _ONEDNN_BF16_CAPS:
        return Bf16Support(False, f"{found}, but ONEDNN_MAX_CPU_ISA={onednn} holds oneDNN below it")
    aten = environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten and aten not in _ATEN_BF16_LEVELS:
        return Bf16Support(False, f"{found}, but ATEN_CPU_CAPABILITY={aten} holds torch below it")
    return Bf16Support(True, found)
