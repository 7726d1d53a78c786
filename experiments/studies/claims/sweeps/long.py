"""Claim C4 (stability up to k = 128): longer runs where the lag reaches k, beside sync, x seeds.

`--sweep=experiments/studies/claims/sweeps/long.py:k=128,steps=160,arms=vcpo+seq_tis,seeds=2` (defaults shown). Lag
emulation makes the lag at step t min(t, k), so a lag of k needs more than k steps: with 160 steps and
k = 128, steps 128-159 train on batches 128 versions old (and every earlier batch comes from the warm start).
Evaluated every 20 steps on the main job's 128 held-out problems.
"""
from experiments.launch.sweep import chain, fixed, parse_arg, product, sweep
from experiments.studies.claims.sweeps import arms


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, k=128, steps=160, arms=["vcpo", "seq_tis"], seeds=2, lr=2e-4)
  long = {"rl.mode": "emulate", "rl.steps": a["steps"], "task.eval_size": 128, "eval_every": 20,
          "checkpoint_every": 40}
  sync = product(arms.arms(["sync"], a["lr"]), fixed({"rl.max_lag": 0}))
  stale = product(arms.arms(a["arms"], a["lr"]), fixed({"rl.max_lag": a["k"]}))
  per_seed = [product(chain(stale, sync), sweep("config.seed", [s])) for s in range(a["seeds"])]
  return product(chain(*per_seed), fixed(long))
