"""The request-level differential state machine under pytest: spec manager vs KVCacheManager.

Full attention and sliding window, each with pagedkv's semantics (invalid calls included) and
with vLLM 0.8.5 semantics (valid calls only). Caching on and off, use_eagle on and off, both hash
functions and log_stats are drawn per run by the machine's set-up rule.
"""

from __future__ import annotations

from pagedkv.harness.adapters import pagedkv_manager
from pagedkv.harness.manager_machine import make_manager_machine
from pagedkv.semantics import VLLM_0_8_5

TestFullAttention = make_manager_machine(pagedkv_manager, sliding_window=False).TestCase
TestSlidingWindow = make_manager_machine(pagedkv_manager, sliding_window=True).TestCase
TestFullAttentionVllm = make_manager_machine(
    pagedkv_manager, sliding_window=False, semantics=VLLM_0_8_5, misuse=False
).TestCase
TestSlidingWindowVllm = make_manager_machine(
    pagedkv_manager, sliding_window=True, semantics=VLLM_0_8_5, misuse=False
).TestCase
