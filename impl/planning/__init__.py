"""pagedkv.planning: how many blocks fit, before a manager is built.

KV cache configs from a memory budget (`kv_cache_config`, vLLM 0.8.5's one group;
`kv_cache_groups`, vLLM 0.33's groups for hybrid models), the memory a GPU leaves for them
(`available_memory`), the weights' share of it estimated from a config (`weights`), one block
count across workers (`distributed`), model shapes from Hugging Face configs (`hf_config`), the
planner (`plan`, with vLLM 0.33's hybrid layout beside it: `hybrid_layout`) and its command
(`cli`, `pagedkv plan`).
"""
