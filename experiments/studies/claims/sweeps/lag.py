"""Stability versus lag: chosen arms at k in {0, 4, 16, 64, 128} under deterministic lag emulation, x seeds.

`--sweep=experiments/studies/claims/sweeps/lag.py:lags=0+4+16+64+128,arms=no_correction+seq_tis+ess_only+vcpo,seeds=3`
(defaults shown). k = 0 units of every arm are that arm run synchronously.
"""
from experiments.launch.sweep import fixed, parse_arg, product, seeds, sweep
from experiments.studies.claims.sweeps import arms


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, lags=[0, 4, 16, 64, 128], arms=["no_correction", "seq_tis", "ess_only", "vcpo"], seeds=3,
                lr=2e-4, mode="emulate")
  return product(arms.arms(a["arms"], a["lr"]), sweep("config.rl.max_lag", a["lags"]),
                 fixed({"rl.mode": a["mode"]}), seeds(a["seeds"]))
