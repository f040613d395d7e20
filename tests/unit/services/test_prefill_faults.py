"""The prefill's `forge_checksum` fault: its forgery changes bytes and keeps the buffer's checksum
(CRC32 on the host, wsum64 on a device), so only the seal's MAC can catch it."""

import pytest
import torch

from rekv_core.codecs.checksum import checksum
from services.prefill.faults import forged_keeping_checksum


@pytest.mark.parametrize("algorithm", ["crc32", "wsum64"])
@pytest.mark.parametrize("n", [8, 9, 12, 4097, 600_001])  # the last: weights past 65521
def test_the_forgery_keeps_the_checksum_and_changes_the_bytes(algorithm, n):
    generator = torch.Generator().manual_seed(n)
    buffer = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
    forged = forged_keeping_checksum(buffer, algorithm)
    changed = int((forged != buffer).sum())
    assert 1 <= changed <= 8
    assert checksum(forged, algorithm) == checksum(buffer, algorithm)
