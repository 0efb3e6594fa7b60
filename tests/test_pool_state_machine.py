"""The block-pool differential state machine under pytest: spec vs pagedkv's BlockPool.

Run for pagedkv's semantics with misuse (invalid calls must raise the same error and change
nothing), and for vLLM 0.8.5 semantics with valid calls only.
"""

from __future__ import annotations

from pagedkv.harness.adapters import pagedkv_pool
from pagedkv.harness.pool_machine import make_pool_machine
from pagedkv.semantics import VLLM_0_8_5

TestPagedKVPool = make_pool_machine(pagedkv_pool).TestCase
TestVllmConformantPool = make_pool_machine(
    pagedkv_pool, semantics=VLLM_0_8_5, misuse=False
).TestCase
