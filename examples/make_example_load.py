#!/usr/bin/env python3
"""Writes examples/dsv3_load.json: a DeepSeek-V3-shaped load (58 layers x 256 experts).

Each layer is Zipf-like (exponent 0.7-1.3, experts shuffled per layer) with integer token
counts, as a real per-window routing histogram looks. Deterministic (seed 2026); standard
library only, so any python3 can rerun it.
"""
import json
import random

rng = random.Random(2026)
layers = []
for _ in range(58):
    s = rng.uniform(0.7, 1.3)
    ranks = list(range(256))
    rng.shuffle(ranks)
    layers.append([round(200000.0 / (ranks[e] + 1) ** s) for e in range(256)])
with open("dsv3_load.json", "w") as f:
    json.dump({"load": layers}, f, separators=(",", ":"))
    f.write("\n")
