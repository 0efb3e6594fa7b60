"""pagedkv.harness.machines: hypothesis state machines over the simulated clients.

Each rule draws one of the client's operations; the client runs it on a pair in full mode.
Hypothesis chooses and shrinks the operations; what they do, and what is compared, is the
client's (`pagedkv.harness.client`).
"""
