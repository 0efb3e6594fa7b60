"""pagedkv.vocab: the words spec and implementation share, and nothing they decide.

Errors and the wording of each refusal (`errors`, `refusals`), argument type checks
(`arguments`), the `Request` type (`request`), KV cache specs and configs
(`kv_cache_interface`), block keys and hash functions (`hashes`), the semantics switches
(`semantics`), KV cache event records (`kv_events`) and the prefix-cache stats record
(`prefix_cache_stats`). Which argument of which call must satisfy which rule, and what each
operation does, is decided on each side: `pagedkv.spec` plainly, `pagedkv` fast. Standard
library only.
"""
