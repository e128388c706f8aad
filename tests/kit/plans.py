"""Save plans of fixed declarations built without hypothesis, as JSON: the ownership tests
compare the plan computed here with the one computed in processes of other hash seeds."""

from __future__ import annotations

import json
import random

from ckptfmt.plan.ownership import Holding, make_plan

DTYPES = ["uint8", "bfloat16", "float32", "float64", "complex128"]
Decl = list[list[Holding]]


def fixed_cases() -> list[tuple[Decl, int, int]]:
    """A few cases built without hypothesis (every process rebuilds the same ones)."""
    rng = random.Random(2024)
    out = []
    words = ["model", "opt", "layer.0", "layer.1", "w", "b", "emb", "\u00e9t\u00e9", "x"]
    for _ in range(25):
        world = rng.choice([2, 3, 4, 6])
        decl: Decl = [[] for _ in range(world)]
        for i in range(rng.randint(2, 7)):
            name = (rng.choice(words), f"{rng.choice(words)}{i}")
            dtype = rng.choice(DTYPES)
            shape = (rng.randint(1, 40), rng.randint(1, 9))
            if rng.random() < 0.5:
                for r in range(world):
                    decl[r].append(Holding(name, dtype, shape))
            else:
                rows = [0, *sorted(rng.randint(0, shape[0]) for _ in range(world - 1)), shape[0]]
                for r in range(world):
                    box = ((rows[r], 0), (rows[r + 1] - rows[r], shape[1]))
                    decl[r].append(Holding(name, dtype, shape, box))
        out.append((decl, rng.choice([8, 64, 256]), rng.choice([256, 1024, 4096])))
    return out


def plans_json() -> str:
    """The plans of :func:`fixed_cases` as one JSON document."""
    docs = []
    for decl, chunk, shard in fixed_cases():
        plan = make_plan(decl, chunk, shard)
        docs.append(
            [
                [
                    list(t.name),
                    t.dtype,
                    t.shard_shape,
                    t.chunk_shape,
                    [[r.offset, r.shape, r.writer] for r in t.regions],
                ]
                for t in plan.tensors
            ]
        )
    return json.dumps(docs)
