"""A CPU SIMT emulator that runs pagedkv's exact kernel text (what NVRTC compiles).

`build` compiles a kernel source with the host C++ compiler against `simt_runtime.h` (one
fiber per CUDA thread, randomized order between synchronization points, NaN-poisoned cp.async
destinations, guard pages around every array) into a small executable; `launch` drives it with
NumPy arrays; `attention` runs `paged_attention` / `write_kv` through it exactly as the CuPy
launcher would on a device. What it models and what it does not: gpu/README.md.
"""
