"""CUDA's occupancy arithmetic on the CPU (`pagedkv.gpu.occupancy`): the edges that decide it.

The compiled kernels' own figures (ptxas registers, the host's shared-memory sizes) are checked
against their launch bounds in tests/test_gpu_compile.py; the first device run compares both
with the driver's answer.
"""

from __future__ import annotations

import pytest

from pagedkv.gpu.attention_plan import H200, DeviceLimits
from pagedkv.gpu.occupancy import SM80, SM90, ctas_per_sm
from pagedkv.vocab.errors import InvalidArgumentError


def test_the_per_cta_reservation_decides_four_or_three_ctas() -> None:
    """Four CTAs of 57,344 bytes fill 228 KiB with the 1 KiB each CTA costs on top; one byte
    more rounds each CTA up by 128 and only three fit, though 4 x 57,345 is far below 228 KiB."""
    fits = ctas_per_sm(SM90, 128, 64, 57_344)
    assert (fits.ctas, fits.shared_per_cta, fits.limited_by) == (4, 58_368, "shared memory")
    over = ctas_per_sm(SM90, 128, 64, 57_345)
    assert (over.ctas, over.shared_per_cta, over.limited_by) == (3, 58_496, "shared memory")
    assert SM90.shared_per_sm > 4 * 57_345, "without the reservation four would seem to fit"
    assert [H200.resident_ctas(smem, 4) for smem in (57_344, 57_345)] == [4, 3]


def test_registers_round_up_to_eight_per_thread_within_each_sub_partition() -> None:
    assert ctas_per_sm(SM90, 128, 128, 0).by_registers == 4  # 4 warps of 4096 per quarter
    assert ctas_per_sm(SM90, 128, 121, 0).by_registers == 4  # rounds up to 128
    assert ctas_per_sm(SM90, 128, 129, 0).by_registers == 3  # 136: 3 warps per quarter
    assert ctas_per_sm(SM90, 128, 192, 0).by_registers == 2
    assert ctas_per_sm(SM90, 256, 64, 0).by_registers == 4  # 8 warps of 2048 per quarter
    assert ctas_per_sm(SM90, 64, 32, 0).by_threads == 32  # the CTA count, not the threads


def test_an_a100_holds_fewer_ctas_of_the_same_shared_memory() -> None:
    assert ctas_per_sm(SM80, 128, 96, 45_184).ctas == 3
    assert ctas_per_sm(SM90, 128, 96, 45_184).ctas == 5
    a100 = DeviceLimits(num_sms=108, shared_memory_per_sm=SM80.shared_per_sm)
    assert a100.resident_ctas(45_184, 5) == 3


def test_a_launch_no_sm_can_hold_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="shared memory"):
        ctas_per_sm(SM90, 128, 64, SM90.max_shared_per_cta + 1)
    with pytest.raises(InvalidArgumentError, match="registers"):
        ctas_per_sm(SM90, 128, 256, 0)
    with pytest.raises(InvalidArgumentError, match="threads"):
        ctas_per_sm(SM90, 1025, 32, 0)
