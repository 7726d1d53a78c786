"""The optimizer study (docs/results/optimizer/): OPOB under SGD + momentum, and C3's OPOB-only arm under Adam."""
