"""CPU CI compiles every kernel variant to a cubin for sm_80 and sm_90, without a GPU.

NVRTC is called directly (no driver needed); a compile error in any `.cu` file, any template
instantiation, or a host/kernel disagreement on launch constants (the generated static_asserts)
fails here. Every cubin the loader caches is checked with the CUDA tools themselves
(`cuobjdump`, `nvdisasm`, from the pinned `nvidia-cuda-*` wheels), and ptxas' resource report
must show no register spills and registers that let an H200 hold the CTAs per SM the launch
bounds and the split policy assume. The tensor-core decode loop's SASS must stay within its
budget of warp instructions per key (`SASS_BUDGETS`).
"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedkv.gpu import kernel_loader
from pagedkv.gpu.attention_plan import H200
from pagedkv.gpu.cubin_image import check_cubin, cuda_tool, image_extent
from pagedkv.gpu.errors import KernelCompileError
from pagedkv.gpu.kernel_variants import (
    ATTENTION_DTYPES,
    ATTENTION_KERNELS,
    ATTENTION_SOURCE,
    CI_ARCHS,
    HEAD_SIZES,
    KERNEL_SOURCES,
    MMA_ATTENTION_SOURCE,
    MMA_DTYPES,
    WRITE_SOURCE,
    AttentionTraits,
    KernelSource,
    attention_kernel_name,
    attention_source,
    attention_traits,
)
from pagedkv.gpu.nvrtc_build import (
    CompiledModule,
    cache_key,
    compile_options,
    compile_source,
    read_cubin,
    source_text,
)
from pagedkv.gpu.occupancy import SM90, ctas_per_sm
from pagedkv.gpu.ptxas_usage import cubin_resources
from pagedkv.gpu.sass_count import disassemble, hot_loop, instructions_per_key

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


def _tool(name: str) -> Path:
    path = cuda_tool(name)
    assert path is not None, f"{name} is pinned in the dev install (cuda-toolkit[{name}])"
    return path


@pytest.fixture(scope="module")
def cached_cubins(
    compiled: dict[tuple[str, int], CompiledModule],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, int], Path]:
    """Every cubin as the loader writes it into a fresh cache (no second compile)."""
    directory = tmp_path_factory.mktemp("kernel-cache")
    paths = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDKV_KERNEL_CACHE", str(directory))
        patch.setattr(kernel_loader, "compile_source", lambda s, a: compiled[(s.file_name, a)])
        for source in KERNEL_SOURCES:
            for arch in CI_ARCHS:
                paths[(source.file_name, arch)], _ = kernel_loader.cubin_path(source, arch)
    return paths


def test_every_cached_cubin_is_the_exact_image_nvrtc_reports(
    compiled: dict[tuple[str, int], CompiledModule], cached_cubins: dict[tuple[str, int], Path]
) -> None:
    for key, path in cached_cubins.items():
        image = path.read_bytes()
        assert image == compiled[key].cubin
        assert image_extent(image) == len(image), "ELF headers and file size agree"


def test_cuobjdump_and_nvdisasm_accept_every_cached_cubin(
    compiled: dict[tuple[str, int], CompiledModule], cached_cubins: dict[tuple[str, int], Path]
) -> None:
    cuobjdump, nvdisasm = _tool("cuobjdump"), _tool("nvdisasm")
    for key, path in cached_cubins.items():
        listing = subprocess.run(
            [cuobjdump, "-elf", path], capture_output=True, text=True, check=True, timeout=60
        ).stdout
        assert f"sm={key[1]}," in listing
        for symbol in compiled[key].lowered_names.values():
            assert f".text.{symbol}" in listing, f"{symbol} has code in {path.name}"
        disassembly = subprocess.run(
            [nvdisasm, path], capture_output=True, text=True, check=True, timeout=60
        ).stdout
        assert "EXIT" in disassembly


def test_cupys_getcubin_drops_the_last_byte_and_the_tools_reject_that_image(
    tmp_path: Path,
) -> None:
    """The defect the loader had: CuPy's getCUBIN returns nvrtcGetCUBINSize - 1 bytes."""
    from cupy_backends.cuda.libs import nvrtc

    module = compile_source(WRITE_SOURCE, 90)
    program = nvrtc.createProgram(source_text(WRITE_SOURCE), WRITE_SOURCE.file_name, [], [])
    try:
        nvrtc.compileProgram(program, list(compile_options(90)))
        exact = read_cubin(nvrtc, program)
        short = bytes(nvrtc.getCUBIN(program))
    finally:
        nvrtc.destroyProgram(program)
    assert len(short) == len(exact) - 1 and exact.startswith(short)
    for image in (short, module.cubin[:-1]):
        with pytest.raises(KernelCompileError, match="truncated"):
            check_cubin(image, "cut")
    with pytest.raises(KernelCompileError, match="trailing bytes"):
        check_cubin(module.cubin + b"\0", "padded")
    (tmp_path / "short.cubin").write_bytes(module.cubin[:-1])
    result = subprocess.run(
        [_tool("nvdisasm"), tmp_path / "short.cubin"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0, "nvdisasm refuses the truncated image too"


def test_a_truncated_cache_entry_is_rebuilt_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path))
    path, _ = kernel_loader.cubin_path(WRITE_SOURCE, 80)
    good = path.read_bytes()
    path.write_bytes(good[:-1])  # what the old loader cached
    rebuilt, names = kernel_loader.cubin_path(WRITE_SOURCE, 80)
    assert rebuilt == path and path.read_bytes() == good
    assert set(names) == set(WRITE_SOURCE.name_expressions)


def test_ptxas_reports_every_kernel_and_no_variant_spills(
    compiled: dict[tuple[str, int], CompiledModule],
) -> None:
    for (file_name, arch), module in compiled.items():
        assert set(module.usage) == set(module.lowered_names.values()), file_name
        for usage in module.usage.values():
            assert usage.arch == arch and usage.registers > 0
            assert not usage.spills, f"{usage.symbol} spills on sm_{arch}: {usage}"


def test_the_cubins_resource_listing_agrees_with_ptxas(
    compiled: dict[tuple[str, int], CompiledModule], cached_cubins: dict[tuple[str, int], Path]
) -> None:
    """What the first device run reads from a cached cubin (its compile log is gone) is what
    ptxas reported: registers, and static shared memory once sm_90's 1 KiB reservation that
    cuobjdump lists with it is taken off."""
    for key, path in cached_cubins.items():
        listed = cubin_resources(path, key[1])
        usage = compiled[key].usage
        assert set(listed) == set(usage)
        for symbol, (registers, static) in listed.items():
            assert (registers, static) == (
                usage[symbol].registers,
                usage[symbol].static_shared_bytes,
            )


def test_every_attention_variant_holds_its_launch_bounds_ctas_on_an_h200(
    compiled: dict[tuple[str, int], CompiledModule],
) -> None:
    """Registers and static shared memory as ptxas reports them, dynamic shared memory as the
    host launches it: an H200 SM holds at least the CTAs `__launch_bounds__` asks for, and for
    the tensor-core kernel exactly that many, which is what the split policy plans with."""
    for kernel in ATTENTION_KERNELS:
        module = compiled[(attention_source(kernel).file_name, 90)]
        for dtype in ATTENTION_DTYPES:
            if kernel == "mma" and dtype not in MMA_DTYPES:
                continue
            for head in HEAD_SIZES:
                traits = attention_traits(dtype, head, kernel)
                symbol = module.lowered_names[attention_kernel_name(dtype, head, kernel)]
                usage = module.usage[symbol]
                occupancy = ctas_per_sm(
                    SM90,
                    traits.threads,
                    usage.registers,
                    traits.smem_bytes,
                    usage.static_shared_bytes,
                )
                assert occupancy.ctas >= traits.min_ctas_per_sm, (kernel, dtype, head, occupancy)
                if kernel == "mma":
                    planned = H200.resident_ctas(traits.smem_bytes, traits.min_ctas_per_sm)
                    assert occupancy.ctas == traits.min_ctas_per_sm == planned, (dtype, head)


SASS_BUDGETS: dict[tuple[str, int], float] = {
    ("float16", 64): 22.5,
    ("bfloat16", 64): 22.5,
    ("float16", 128): 36.0,
    ("bfloat16", 128): 36.0,
    ("float16", 256): 51.0,
    ("bfloat16", 256): 51.0,
}
"""Warp instructions per key the tensor-core decode loop may issue on sm_90 (a CTA's total,
as `sass_count.instructions_per_key` counts them; the goal of issue 23: 50 at D=128). A change
that costs more fails here; one that saves lowers the budget."""
MMA_BARRIERS_PER_TILE = 2
"""Barriers B and C of paged_attention_mma.cu's main loop."""


def _mma_per_tile(traits: AttentionTraits) -> int:
    """MMAs a warp issues per tile: Q.K (k16) on its n-tiles, P.V (tf32 k8) hi and lo."""
    key_tiles = traits.tile_tokens // 32  # 8-key n-tiles per warp (4 warps)
    dim_tiles = traits.head_size // 32  # 8-dimension n-tiles per warp
    return key_tiles * traits.head_size // 16 + dim_tiles * traits.tile_tokens // 8 * 2


def test_the_decode_loop_stays_within_its_sass_budget_per_key(
    compiled: dict[tuple[str, int], CompiledModule], cached_cubins: dict[tuple[str, int], Path]
) -> None:
    key = (MMA_ATTENTION_SOURCE.file_name, 90)
    functions = disassemble(cached_cubins[key])
    measured = {}
    for (dtype, head), budget in SASS_BUDGETS.items():
        traits = attention_traits(dtype, head, "mma")
        loop = hot_loop(
            functions[compiled[key].lowered_names[attention_kernel_name(dtype, head, "mma")]]
        )
        tiles, rest = divmod(loop.count("BAR"), MMA_BARRIERS_PER_TILE)
        assert rest == 0 and tiles >= 1, f"{loop.count('BAR')} barriers in the loop"
        assert loop.count("HMMA") == tiles * _mma_per_tile(traits), "one tile per barrier pair"
        per_key = instructions_per_key(loop, traits.threads // 32, tiles * traits.tile_tokens)
        measured[(dtype, head)] = round(per_key, 1)
        assert per_key <= budget, f"{dtype} D={head}: {per_key:.1f} per key > {budget}"
    print(f"warp instructions per key, sm_90: {measured}")
