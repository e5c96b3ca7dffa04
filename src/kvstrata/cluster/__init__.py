"""Cluster mode: workers on many nodes, found through a member list (etcd), keys placed by rendezvous hashing.

- :mod:`kvstrata.cluster.membership`: the member list's interface, its ``inproc://`` backend and
  :func:`open_membership`, which picks a backend by the address's scheme;
- :mod:`kvstrata.cluster.etcd`: the ``etcd://`` backend (leases, so a dead worker drops out);
- :mod:`kvstrata.cluster.placement`: which nodes hold a key.

Workers join with ``kvstrata worker --cluster etcd://HOST:2379/NAME``; clients route each key to its nodes
through :class:`kvstrata.client.cluster.ClusterClient` (``kvstrata.connect(cluster=...)``).
"""

from kvstrata.cluster.membership import DEFAULT_TTL_S, InProcessMembership, Member, Membership, open_membership
from kvstrata.cluster.placement import owners, rank

__all__ = ["DEFAULT_TTL_S", "InProcessMembership", "Member", "Membership", "open_membership", "owners", "rank"]
