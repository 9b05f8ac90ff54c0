"""The admission decision, a pipeline of steps (see `handler`): one module each, each returning a value.

- `context`: the ledger port, the cluster view, the settings and metrics a step may use;
- `triage`: what kind of request it is; `intent`: what a GPU pod asks for, resolved once;
- `earlier`: a reinvocation's earlier pass; `naming`: reservation names, a taken pod name;
- `debug`: debug containers, which see their pod's own GPUs (as its booking confirms them) or none;
- `place`: view, node constraints, `limits`, choice and `commit`, with the conflict loop;
- `queueing` and `refusal`: a pod that waits, or is refused (and a hold for its next try);
- `budget`: the guardrail variables; `outcome`: the one patch;
- `handler`: the deadline, errors, metrics and the log line around it all.
"""

from vramshare_webhook.admission.context import ClusterView, Context, Ledger
from vramshare_webhook.admission.earlier import not_an_earlier_pass
from vramshare_webhook.admission.handler import Admitter
from vramshare_webhook.admission.naming import reservation_name

__all__ = ["Admitter", "ClusterView", "Context", "Ledger", "not_an_earlier_pass", "reservation_name"]
