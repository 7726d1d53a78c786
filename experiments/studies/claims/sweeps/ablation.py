"""The ablation at one lag: sync, its lr controls, and every async arm, x seeds.

`--sweep=experiments/studies/claims/sweeps/ablation.py:k=64,seeds=3,lr=0.0002` (defaults shown; lr is the main job's
optim.learning_rate). All units use deterministic lag emulation (rl.mode=emulate).
"""
from experiments.launch.sweep import chain, fixed, parse_arg, product, seeds, sweep
from experiments.studies.claims.sweeps import arms


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, k=64, seeds=3, lr=2e-4)
  sync = product(chain(arms.arms(["sync"], a["lr"]), arms.lr_controls(a["lr"])), fixed({"rl.max_lag": 0}))
  stale = product(arms.arms(arms.ASYNC_ARMS, a["lr"]), sweep("config.rl.max_lag", [a["k"]]))
  return product(chain(sync, stale), fixed({"rl.mode": "emulate"}), seeds(a["seeds"]))
