"""The reservation ledger in the API server, with an atomic commit that holds across webhook replicas.

One object, `KubeLedger`, in four rooms:

- `view`: the watch caches and the snapshot an admission decides on (live, or a consistent read);
- `commit`: the commit protocol, with the argument that it holds across replicas;
- `lookups`: a booking as stored, a reinvocation's claim, pods, holds;
- `queue`: queue entries placed and taken back, holds withdrawn.
"""

from vramshare.kube.ledger.commit import CommitProtocol
from vramshare.kube.ledger.lookups import LedgerLookups
from vramshare.kube.ledger.queue import QueueWrites
from vramshare.kube.ledger.view import ACTIVE, FollowedStreams, LedgerView, last_commit_version


class KubeLedger(LedgerLookups, QueueWrites):
    """The reservation ledger: its view, commits, look-ups and queue writes."""


__all__ = ["ACTIVE", "CommitProtocol", "FollowedStreams", "KubeLedger", "LedgerView", "last_commit_version"]
