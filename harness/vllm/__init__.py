"""pagedkv.harness.vllm: vLLM releases' own KV cache code as an implementation under test.

`wheel` fetches a release's few source files from PyPI, `v0_8_5` and `v0_33` adapt its pool and
manager to the harness protocols (with stand-ins for the rest of vllm and views of pagedkv's
requests: `stand_ins_0_33`, `views`; `v0_32` is `v0_33` with what 0.32.0 changed), and
`against` prepares `pagedkv verify --against`.
"""
