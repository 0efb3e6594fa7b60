"""pagedkv's own side of every deliberate difference from vLLM, stated by the spec.

Every switch of `Semantics` is written out here, none taken from a default, so that the spec's
behaviour never rests on the shared `Semantics` class or `pagedkv.vocab.semantics.PAGEDKV`: a
mistake there changes what the implementation does, not what the spec says it must do, and the
differential campaigns (which build the implementation with its own default and check it against
this) catch it. docs/semantics.md says what each switch means.
"""

from __future__ import annotations

from pagedkv.vocab.semantics import Semantics

PAGEDKV_SEMANTICS = Semantics(
    null_block_refcounted=False,  # the null block's ref_cnt stays 0 (difference 1)
    capacity_counts_null_blocks=False,  # a null hit takes no free block (difference 2)
    vllm_new_block_mm_keys=False,  # a block's multimodal keys never depend on the path (6)
    cap_at_max_model_len=False,  # an allocation past max_model_len is refused (difference 7)
    usage_excludes_null_block=False,  # usage counts the null block as used, as vLLM 0.8.5
    free_uncached_to_head=False,  # every freed block joins the tail, as vLLM 0.8.5
    free_tail_first_without_caching=False,  # without caching, free in order, as vLLM 0.8.5
    lookup_hashes_every_full_block=False,  # a lookup reads the stored hashes, as vLLM 0.8.5
    deferred_free_flattened=False,  # a deferred free keeps free's order (vLLM 0.33: #48489)
    junction_ignores_eagle=False,  # with EAGLE a junction keeps the run a block lower too
    mamba_remarks_keyed_boundary=False,  # only a state keyed now defers a sibling's hit
)
"""The semantics the spec takes unless told otherwise."""
