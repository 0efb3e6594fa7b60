"""pagedkv.harness.client: the one simulated client of each layer.

`ManagerClient` plays a scheduler over a pair of managers; `PoolClient` makes a manager's calls
(and every other call) over a pair of pools. Each runs operations (`manager_ops`, `pool_ops`:
plain replayable records) that any driver chooses: the swarm samples them, the hypothesis
machines draw them, the exhaustive search enumerates them. The client keeps its own record of
every request it sent (`requests`), takes and replays KV cache events (`events`), and makes the
hostile calls of its catalogs (`hostile`, `catalog`).
"""

from pagedkv.harness.client.manager import ManagerClient
from pagedkv.harness.client.pool import PoolClient

__all__ = ["ManagerClient", "PoolClient"]
