"""How many CTAs of a kernel one SM holds: CUDA's occupancy rules, computed on the CPU.

The inputs are what ptxas reports (registers per thread, static shared memory: `ptxas_usage`)
and what the launch asks for (threads, dynamic shared memory); the rules are those of CUDA's
occupancy calculator (`cuda_occupancy.h`) for sm_80 and sm_90:

- threads: at most `max_threads` per SM, and at most `max_ctas` CTAs;
- registers: a warp's registers are allocated in units of `register_unit` (so registers per
  thread round up to a multiple of 8), out of each of the four sub-partitions' quarter of the
  register file, one warp of a CTA per sub-partition in turn;
- shared memory: a CTA holds its static plus dynamic shared memory plus `reserved_shared`
  bytes the system keeps per CTA, rounded up to `shared_unit`, out of `shared_per_sm` (the
  largest carveout, which the launcher asks for).

The reservation decides cases at the edge: four CTAs of 57,344 bytes fill an H200's 228 KiB
exactly; one more byte each and only three fit, although four times 57,345 is well below it.
The first device run asks the driver (`cudaOccupancyMaxActiveBlocksPerMultiprocessor`) and
records both figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.vocab.errors import InvalidArgumentError


@dataclass(frozen=True)
class SmResources:
    """One SM generation's limits.

    Attributes:
        max_threads: resident threads per SM.
        max_ctas: resident CTAs per SM.
        registers: 32-bit registers per SM (four sub-partitions share them equally).
        register_unit: registers a warp is allocated at a time.
        max_registers_per_thread: the most a kernel may use.
        shared_per_sm: shared memory per SM at the largest carveout, bytes.
        max_shared_per_cta: the most one CTA may use (dynamic shared memory opted in).
        shared_unit: shared memory allocation granularity, bytes.
        reserved_shared: shared memory the system reserves per CTA, bytes.
    """

    max_threads: int
    max_ctas: int
    registers: int
    register_unit: int
    max_registers_per_thread: int
    shared_per_sm: int
    max_shared_per_cta: int
    shared_unit: int
    reserved_shared: int


SM90 = SmResources(
    max_threads=2048,
    max_ctas=32,
    registers=65536,
    register_unit=256,
    max_registers_per_thread=255,
    shared_per_sm=228 * 1024,
    max_shared_per_cta=227 * 1024,
    shared_unit=128,
    reserved_shared=1024,
)
"""H100 / H200 (compute capability 9.0)."""

SM80 = SmResources(
    max_threads=2048,
    max_ctas=32,
    registers=65536,
    register_unit=256,
    max_registers_per_thread=255,
    shared_per_sm=164 * 1024,
    max_shared_per_cta=163 * 1024,
    shared_unit=128,
    reserved_shared=1024,
)
"""A100 (compute capability 8.0)."""

SUB_PARTITIONS = 4


@dataclass(frozen=True)
class Occupancy:
    """Resident CTAs per SM and what limits them.

    Attributes:
        ctas: CTAs per SM (the least of the three limits).
        by_threads: the limit from threads and the CTA count.
        by_registers: the limit from registers.
        by_shared: the limit from shared memory.
        shared_per_cta: bytes one CTA takes, reservation and rounding included.
    """

    ctas: int
    by_threads: int
    by_registers: int
    by_shared: int
    shared_per_cta: int

    @property
    def limited_by(self) -> str:
        """The limit that binds (the first of threads, registers, shared memory on a tie)."""
        limits = {
            "threads": self.by_threads,
            "registers": self.by_registers,
            "shared memory": self.by_shared,
        }
        return min(limits, key=lambda name: limits[name])


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def ctas_per_sm(
    sm: SmResources, threads: int, registers: int, dynamic_shared: int, static_shared: int = 0
) -> Occupancy:
    """Resident CTAs per SM of a kernel launched with `threads` threads per CTA.

    Args:
        sm: the SM generation.
        threads: threads per CTA.
        registers: registers per thread (ptxas).
        dynamic_shared: dynamic shared memory per CTA, bytes.
        static_shared: `__shared__` memory per CTA, bytes (ptxas).

    Raises:
        InvalidArgumentError: the launch cannot run at all (too many threads, registers or
            bytes of shared memory for one CTA).

    Complexity: O(1).
    """
    shared = static_shared + dynamic_shared
    if not 0 < threads <= 1024 or not 0 < registers <= sm.max_registers_per_thread:
        raise InvalidArgumentError(f"no CTA of {threads} threads x {registers} registers runs")
    if shared > sm.max_shared_per_cta:
        raise InvalidArgumentError(f"{shared} bytes of shared memory exceed one CTA's maximum")
    warps = -(-threads // 32)
    by_threads = min(sm.max_ctas, sm.max_threads // (32 * warps))
    registers_per_warp = _round_up(registers * 32, sm.register_unit)
    warps_per_partition = sm.registers // SUB_PARTITIONS // registers_per_warp
    by_registers = warps_per_partition * SUB_PARTITIONS // warps
    shared_per_cta = _round_up(shared + sm.reserved_shared, sm.shared_unit)
    by_shared = sm.shared_per_sm // shared_per_cta
    return Occupancy(
        ctas=min(by_threads, by_registers, by_shared),
        by_threads=by_threads,
        by_registers=by_registers,
        by_shared=by_shared,
        shared_per_cta=shared_per_cta,
    )
