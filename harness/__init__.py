"""pagedkv.harness: the differential harness, the spec against any implementation, step by step.

The shared core is here: the interfaces a pool or manager must offer (`protocol`), adapters for
objects shaped like vLLM's and the default factories (`adapters`), the one lock-step comparison
(`comparison`), the domain an implementation supports (`domain`), coverage counting and targets
(`coverage`), and `pagedkv verify` (`verify`, the one CLI). Around it, in wings:

- `client`: the one simulated client per layer (a scheduler over a manager; a manager's calls
  over a pool) and the operations it runs, with the catalogs of hostile calls;
- `swarm`: the campaign engine (seeded runs that sample the clients' operations, shrinking);
- `machines`: hypothesis state machines that draw the same operations;
- `vllm`: vLLM releases' own code as the implementation under test (`--against`).

The exhaustive search (`proofs/exhaustive`) enumerates the same operations. Only the public
names below are imported here; `machines` (hypothesis) and `vllm` load when used.
"""

from pagedkv.harness.adapters import (
    FlatObjectManagerAdapter,
    ObjectManagerAdapter,
    ObjectPoolAdapter,
    OneGroupAdapter,
    pagedkv_manager,
    pagedkv_pool,
    spec_manager,
    spec_pool,
)
from pagedkv.harness.comparison import ComparedPair
from pagedkv.harness.divergence import Divergence, signature_of
from pagedkv.harness.domain import FULL_DOMAIN, Domain
from pagedkv.harness.protocol import (
    NOT_REPORTED,
    EmitsKVEvents,
    FlatManagerUnderTest,
    KVEventPoolFactory,
    ManagerConfig,
    ManagerFactory,
    ManagerSnapshot,
    ManagerUnderTest,
    PoolFactory,
    PoolSnapshot,
    PoolUnderTest,
)
from pagedkv.harness.verify import main as verify

__all__ = [
    "FULL_DOMAIN",
    "NOT_REPORTED",
    "ComparedPair",
    "Divergence",
    "Domain",
    "EmitsKVEvents",
    "FlatManagerUnderTest",
    "FlatObjectManagerAdapter",
    "KVEventPoolFactory",
    "ManagerConfig",
    "ManagerFactory",
    "ManagerSnapshot",
    "ManagerUnderTest",
    "ObjectManagerAdapter",
    "ObjectPoolAdapter",
    "OneGroupAdapter",
    "PoolFactory",
    "PoolSnapshot",
    "PoolUnderTest",
    "pagedkv_manager",
    "pagedkv_pool",
    "signature_of",
    "spec_manager",
    "spec_pool",
    "verify",
]
