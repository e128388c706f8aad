"""Plans kept by the layout they were made for, so that a job saving the same layout again and
again (every step, or every few) plans it once.

A plan (:func:`~ckptfmt.plan.ownership.make_plan`) depends on nothing but every rank's
declarations (what each holds of each tensor, in order) and the grid options. Its key here is a
digest of exactly those, as JSON (what the ranks exchange anyway), so a changed layout — a tensor
added, a shape or dtype changed, a rank holding another region, another number of ranks, other
grid options — is another key and gets its own plan: a kept plan is only ever used for the
layout it was made for.

One cache serves a manager's staging (the share of the replicated tensors each rank copies, the
plan of every rank declaring them whole) and its saves (the plan of the gathered declarations):
for data parallelism both are the same layout, so the save reuses the stager's plan.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ckptfmt.plan.ownership import Holding, SavePlan, make_plan

__all__ = ["PlanCache", "layout_key"]


def layout_key(declarations: Sequence[Sequence[dict[str, Any]]], chunk: int, shard: int) -> str:
    """The digest of every rank's declarations (``Holding.to_json`` lists, by rank) and the grid
    options: everything a plan depends on. A list given for several ranks (the same object:
    data parallelism, as the staging declares it) is serialised once."""
    seen: dict[int, str] = {}
    total = hashlib.sha256(f"{chunk},{shard},{len(declarations)}".encode())
    for decl in declarations:
        digest = seen.get(id(decl))
        if digest is None:
            doc = json.dumps(decl, separators=(",", ":")).encode("utf-8")
            digest = seen[id(decl)] = hashlib.sha256(doc).hexdigest()
        total.update(digest.encode("ascii"))
    return total.hexdigest()


class PlanCache:
    """The plans of the last ``keep`` layouts. Thread-safe (a manager's staging may run on the
    training thread and its save on the saver thread). ``made``: plans computed; ``reused``:
    plans served from the cache (what a test or a report may look at)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._plans: OrderedDict[str, SavePlan] = OrderedDict()
        self._lock = threading.Lock()
        self.made = 0
        self.reused = 0

    def plan(
        self, declarations: Sequence[Sequence[dict[str, Any]]], chunk: int, shard: int
    ) -> SavePlan:
        """The plan of ``declarations`` (every rank's ``Holding.to_json`` list, by rank): the
        one kept for this layout, else a new one (then kept). Raises what ``make_plan`` raises
        for declarations that cannot be planned (nothing is kept then)."""
        key = layout_key(declarations, chunk, shard)
        with self._lock:
            found = self._plans.get(key)
            if found is not None:
                self._plans.move_to_end(key)
                self.reused += 1
                return found
        made = make_plan(
            [[Holding.from_json(d) for d in decl] for decl in declarations], chunk, shard
        )
        with self._lock:
            self._plans[key] = made
            self.made += 1
            while len(self._plans) > self.keep:
                self._plans.popitem(last=False)
        return made
