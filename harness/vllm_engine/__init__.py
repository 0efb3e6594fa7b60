"""pagedkv.harness.vllm_engine: the vLLM tier, pagedkv's plugin proven on vLLM's own engine.

`models` makes the tiny local checkpoints, `workload` the seeded prompts with shared prefixes,
`run` drives one `vllm.LLM` run in a plugin mode (`off`, `shadow`, `replace`) and compares runs'
tokens, and `probe` (an entry point of `vllm.general_plugins`, inert unless `PAGEDKV_VLLM_PROBE`
is set) records what vLLM's scheduler did inside the engine core. Nothing here imports vLLM,
torch or transformers at import time; they live in `.venv-vllm` (`./dev setup --vllm`).
"""
