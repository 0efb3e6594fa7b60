"""pagedkv.events: what leaves the manager for the outside world.

The KV cache event index and its replay (`index`), a publisher (`publisher`) and its wire forms
(`wire`: vLLM's msgpack and JSON), a Prometheus exporter (`metrics`) and the hit rates it shows
(`prefix_caching_metrics`). The event records themselves are vocabulary (`pagedkv.vocab.kv_events`).
"""
