// Stand-in for the CUDA header of this name: gpu/emulator/simt_runtime.h (force-included)
// already declares what pagedkv's kernels use from it.
#pragma once
