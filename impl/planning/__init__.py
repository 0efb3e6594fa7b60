"""pagedkv.planning: how many blocks fit, before a manager is built.

KV cache configs from a memory budget (`kv_cache_config`), the memory a GPU leaves for them
(`available_memory`), one block count across workers (`distributed`), model shapes from Hugging
Face configs (`hf_config`), the planner (`plan`) and its command (`cli`, `pagedkv plan`).
"""
