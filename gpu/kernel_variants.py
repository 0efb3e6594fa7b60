"""Every kernel instantiation pagedkv compiles, and the launch constants the host mirrors.

Each `.cu` file is one NVRTC translation unit; its templates are instantiated through name
expressions, so one compile per (file, arch) yields every variant. Two attention kernels share
one interface: "mma" (paged_attention_mma.cu: tensor cores, fp16/bf16, the default for them) and
"simt" (paged_attention.cu: CUDA cores, every dtype, the default for fp32, and the split merge).
Their tile constants live in `AttentionTraits` / `MmaAttentionTraits`; `attention_traits`
mirrors them for the host, and each compiled source carries `static_assert`s that both agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

from pagedkv.vocab.errors import InvalidArgumentError

ATTENTION_DTYPES: Mapping[str, str] = {
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float32": "float",
}
"""Query/cache dtypes the attention kernel is instantiated for -> their CUDA type."""

ELEMENT_SIZES: Mapping[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}

HEAD_SIZES: tuple[int, ...] = (64, 128, 256)
"""Head sizes the attention kernel is instantiated for."""

CHECKED_BLOCK_SIZES: tuple[int, ...] = (16, 32)
"""Block sizes `gpu/check.py` runs; the kernels take any power of two (a runtime shift)."""

WRITE_VECTOR_TYPES: Mapping[int, str] = {
    16: "uint4",
    8: "uint2",
    4: "unsigned int",
    2: "unsigned short",
}
"""Copy width in bytes -> the CUDA type the write kernel moves."""

SLOT_INDEX_TYPES: Mapping[str, str] = {"int32": "int", "int64": "long long"}
"""slot_mapping dtypes -> the CUDA index type."""

AttentionKernel: TypeAlias = Literal["mma", "simt"]
ATTENTION_KERNELS: tuple[AttentionKernel, ...] = ("mma", "simt")
MMA_DTYPES: tuple[str, ...] = ("float16", "bfloat16")
"""Dtypes the tensor-core kernel takes (16-bit inputs, fp32 accumulation)."""

ATTENTION_THREADS = 128
ATTENTION_ROWS = 8
MMA_ROWS = 16
MERGE_THREADS = 128
MERGE_PAIRS_PER_CTA = MERGE_THREADS // 32
WRITE_MAX_THREADS = 256


@dataclass(frozen=True)
class KernelSource:
    """One translation unit: a `.cu` file in `pagedkv/gpu` and its instantiations.

    Attributes:
        file_name: the `.cu` file.
        name_expressions: the `__global__` template instantiations to compile.
        extra_source: appended to the file's text (the host-mirror `static_assert`s).
    """

    file_name: str
    name_expressions: tuple[str, ...]
    extra_source: str = ""


@dataclass(frozen=True)
class AttentionTraits:
    """The host's copy of one attention kernel's traits (`AttentionTraits<T, HEAD>` in
    paged_attention.cu, `MmaAttentionTraits<T, HEAD>` in paged_attention_mma.cu).

    Attributes:
        kernel: "mma" or "simt".
        dtype: query/cache dtype name.
        head_size: elements per head.
        threads: threads per CTA.
        rows: query rows (token x head-in-group pairs) per CTA.
        tile_tokens: keys per shared-memory tile.
        smem_bytes: dynamic shared memory per CTA.
        min_ctas_per_sm: the second `__launch_bounds__` argument (registers allow this many).
    """

    kernel: AttentionKernel
    dtype: str
    head_size: int
    threads: int
    rows: int
    tile_tokens: int
    smem_bytes: int
    min_ctas_per_sm: int


def attention_traits(
    dtype: str, head_size: int, kernel: AttentionKernel | None = None
) -> AttentionTraits:
    """The launch constants of one attention variant.

    Args:
        dtype: query/cache dtype name.
        head_size: elements per head.
        kernel: "mma" or "simt"; None: "mma" for fp16/bf16, "simt" for fp32.

    Raises:
        InvalidArgumentError: no such variant.

    Complexity: O(1).
    """
    if dtype not in ATTENTION_DTYPES:
        raise InvalidArgumentError(
            f"paged attention supports dtypes {sorted(ATTENTION_DTYPES)}, got {dtype!r}"
        )
    if head_size not in HEAD_SIZES:
        raise InvalidArgumentError(
            f"paged attention supports head sizes {HEAD_SIZES}, got {head_size!r}"
        )
    if kernel is None:
        kernel = "mma" if dtype in MMA_DTYPES else "simt"
    if kernel == "mma":
        if dtype not in MMA_DTYPES:
            raise InvalidArgumentError(
                f"the tensor-core kernel takes {MMA_DTYPES}, got {dtype!r}; use kernel='simt'"
            )
        return _mma_traits(dtype, head_size)
    if kernel != "simt":
        raise InvalidArgumentError(f"attention kernels are {ATTENTION_KERNELS}, got {kernel!r}")
    elem = ELEMENT_SIZES[dtype]
    vec = 16 // elem
    tile = 8192 // (head_size * elem)
    threads_per_key = ATTENTION_THREADS // tile
    row_chunks = head_size * elem // 16
    row_stride = (row_chunks + threads_per_key % 8) * vec
    kv_bytes = 4 * tile * row_stride * elem
    q_bytes = ATTENTION_ROWS * head_size * 4
    score_bytes = ATTENTION_ROWS * tile * 4
    stat_bytes = 4 * ATTENTION_ROWS * 4
    return AttentionTraits(
        kernel="simt",
        dtype=dtype,
        head_size=head_size,
        threads=ATTENTION_THREADS,
        rows=ATTENTION_ROWS,
        tile_tokens=tile,
        smem_bytes=kv_bytes + q_bytes + score_bytes + stat_bytes,
        min_ctas_per_sm=(2 if elem == 4 else 3) if head_size == 256 else (3 if elem == 4 else 4),
    )


def _mma_traits(dtype: str, head_size: int) -> AttentionTraits:
    tile = 64 if head_size == 64 else 32
    stages = 2 if head_size == 64 else 3
    warps = ATTENTION_THREADS // 32
    kv_bytes = stages * 2 * tile * head_size * 2
    p_bytes = 2 * (tile // 8) * 32 * 16
    max_bytes = MMA_ROWS * warps * 4
    valid_bytes = stages * warps * 4
    return AttentionTraits(
        kernel="mma",
        dtype=dtype,
        head_size=head_size,
        threads=ATTENTION_THREADS,
        rows=MMA_ROWS,
        tile_tokens=tile,
        smem_bytes=kv_bytes + p_bytes + max_bytes + valid_bytes,
        min_ctas_per_sm=2 if head_size == 256 else 4,
    )


def attention_kernel_name(dtype: str, head_size: int, kernel: AttentionKernel = "simt") -> str:
    """The name expression of one attention variant. Complexity: O(1)."""
    template = "paged_attention_mma_kernel" if kernel == "mma" else "paged_attention_kernel"
    return f"pagedkv::{template}<{ATTENTION_DTYPES[dtype]}, {head_size}>"


def merge_kernel_name(dtype: str) -> str:
    """The name expression of one split-KV merge variant. Complexity: O(1)."""
    return f"pagedkv::merge_splits_kernel<{ATTENTION_DTYPES[dtype]}>"


def write_kernel_name(vector_bytes: int, index_dtype: str) -> str:
    """The name expression of one KV-write variant. Complexity: O(1)."""
    return (
        f"pagedkv::write_kv_kernel<{WRITE_VECTOR_TYPES[vector_bytes]}, "
        f"{SLOT_INDEX_TYPES[index_dtype]}>"
    )


def _traits_asserts(kernel: AttentionKernel) -> str:
    lines = ["", "// Generated by pagedkv.gpu.kernel_variants: the host mirror must agree."]
    struct = "MmaAttentionTraits" if kernel == "mma" else "AttentionTraits"
    for dtype, ctype in ATTENTION_DTYPES.items():
        if kernel == "mma" and dtype not in MMA_DTYPES:
            continue
        for head in HEAD_SIZES:
            traits = attention_traits(dtype, head, kernel)
            cuda = f"pagedkv::{struct}<{ctype}, {head}>"
            lines += [
                f"static_assert({cuda}::kSmemBytes == {traits.smem_bytes}, "
                f'"smem bytes {dtype} {head}");',
                f"static_assert({cuda}::kTileN == {traits.tile_tokens}, "
                f'"tile tokens {dtype} {head}");',
                f'static_assert({cuda}::kRows == {traits.rows}, "rows {dtype} {head}");',
                f'static_assert({cuda}::kThreads == {traits.threads}, "threads {dtype} {head}");',
                f"static_assert({cuda}::kMinCtasPerSm == {traits.min_ctas_per_sm}, "
                f'"ctas per sm {dtype} {head}");',
            ]
    return "\n".join(lines) + "\n"


ATTENTION_SOURCE = KernelSource(
    file_name="paged_attention.cu",
    name_expressions=tuple(
        [attention_kernel_name(d, h) for d in ATTENTION_DTYPES for h in HEAD_SIZES]
        + [merge_kernel_name(d) for d in ATTENTION_DTYPES]
    ),
    extra_source=_traits_asserts("simt"),
)

MMA_ATTENTION_SOURCE = KernelSource(
    file_name="paged_attention_mma.cu",
    name_expressions=tuple(
        attention_kernel_name(d, h, "mma") for d in MMA_DTYPES for h in HEAD_SIZES
    ),
    extra_source=_traits_asserts("mma"),
)


def attention_source(kernel: AttentionKernel) -> KernelSource:
    """The translation unit of an attention kernel. Complexity: O(1)."""
    return MMA_ATTENTION_SOURCE if kernel == "mma" else ATTENTION_SOURCE


WRITE_SOURCE = KernelSource(
    file_name="kv_write.cu",
    name_expressions=tuple(
        write_kernel_name(width, index)
        for width in WRITE_VECTOR_TYPES
        for index in SLOT_INDEX_TYPES
    ),
)

KERNEL_SOURCES: tuple[KernelSource, ...] = (ATTENTION_SOURCE, MMA_ATTENTION_SOURCE, WRITE_SOURCE)
"""Every translation unit; CI compiles each for every arch in `CI_ARCHS`."""

CI_ARCHS: tuple[int, ...] = (80, 90)
"""Compute capabilities CPU CI compiles cubins for."""
