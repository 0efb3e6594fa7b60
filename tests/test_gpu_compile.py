"""CPU CI compiles every kernel variant to a cubin for sm_80 and sm_90, without a GPU.

NVRTC is called directly (no driver needed); a compile error in any `.cu` file, any template
instantiation, or a host/kernel disagreement on launch constants (the generated static_asserts)
fails here.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedkv.gpu.errors import KernelCompileError
from pagedkv.gpu.kernel_variants import (
    ATTENTION_DTYPES,
    ATTENTION_SOURCE,
    CI_ARCHS,
    HEAD_SIZES,
    KERNEL_SOURCES,
    WRITE_SOURCE,
    KernelSource,
    attention_kernel_name,
    attention_traits,
)
from pagedkv.gpu.nvrtc_build import CompiledModule, cache_key, compile_source

ELF_MAGIC = b"\x7fELF"


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, int], CompiledModule]:
    """Every (source, arch), compiled once for this module (two threads: NVRTC drops the GIL)."""
    jobs = [(source, arch) for source in KERNEL_SOURCES for arch in CI_ARCHS]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        modules = list(pool.map(lambda job: compile_source(*job), jobs))
    print(f"compiled {len(jobs)} translation units in {time.perf_counter() - started:.1f} s")
    return {(m.source.file_name, m.arch): m for m in modules}


def test_every_variant_compiles_to_a_cubin_for_each_ci_arch(
    compiled: dict[tuple[str, int], CompiledModule],
) -> None:
    assert set(compiled) == {(s.file_name, a) for s in KERNEL_SOURCES for a in CI_ARCHS}
    for (_, arch), module in compiled.items():
        assert module.cubin.startswith(ELF_MAGIC), "a cubin (ELF), never PTX"
        assert module.arch == arch
        lowered = module.lowered_names
        assert set(lowered) == set(module.source.name_expressions)
        assert len(set(lowered.values())) == len(lowered), "each instantiation is its own symbol"
        for symbol in lowered.values():
            assert symbol.encode() in module.cubin, f"{symbol} is in the image"


def test_the_variant_list_covers_every_dtype_and_head_size() -> None:
    names = set(ATTENTION_SOURCE.name_expressions)
    for dtype in ATTENTION_DTYPES:
        for head in HEAD_SIZES:
            assert attention_kernel_name(dtype, head) in names
    assert len(WRITE_SOURCE.name_expressions) == 8  # 4 copy widths x 2 slot index types


def test_cubins_differ_per_arch(compiled: dict[tuple[str, int], CompiledModule]) -> None:
    for source in KERNEL_SOURCES:
        images = {compiled[(source.file_name, arch)].cubin for arch in CI_ARCHS}
        assert len(images) == len(CI_ARCHS)


def test_a_compile_error_raises_with_the_nvrtc_log() -> None:
    broken = KernelSource(
        WRITE_SOURCE.file_name, WRITE_SOURCE.name_expressions, "this is not C++;\n"
    )
    with pytest.raises(KernelCompileError, match=r"kv_write\.cu for sm_90 failed") as info:
        compile_source(broken, 90)
    assert "error" in str(info.value)


def test_a_host_mirror_that_disagrees_with_the_kernel_fails_to_compile() -> None:
    traits = attention_traits("bfloat16", 128)
    wrong = KernelSource(
        ATTENTION_SOURCE.file_name,
        (),
        "static_assert(pagedkv::AttentionTraits<__nv_bfloat16, 128>::kSmemBytes == "
        f'{traits.smem_bytes + 16}, "mirror");\n',
    )
    with pytest.raises(KernelCompileError, match="mirror"):
        compile_source(wrong, 80)


def test_an_arch_nvrtc_cannot_target_raises() -> None:
    with pytest.raises(KernelCompileError, match="sm_20"):
        compile_source(WRITE_SOURCE, 20)


def test_the_cache_key_depends_on_arch_and_source_only() -> None:
    assert cache_key(WRITE_SOURCE, 90) == cache_key(WRITE_SOURCE, 90)
    assert cache_key(WRITE_SOURCE, 90) != cache_key(WRITE_SOURCE, 80)
    assert cache_key(WRITE_SOURCE, 90) != cache_key(ATTENTION_SOURCE, 90)
    edited = KernelSource(WRITE_SOURCE.file_name, WRITE_SOURCE.name_expressions, "// edit\n")
    assert cache_key(edited, 90) != cache_key(WRITE_SOURCE, 90)
