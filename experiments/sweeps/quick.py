"""`make reproduce-quick`: 1 seed, 3 arms (no correction, seq-TIS, VCPO), k in {0, 64}, shortened to fit
<= 15 min on 2 cores. A smoke test of the whole pipeline, not evidence: one seed decides nothing."""
from experiments.sweep import fixed, parse_arg, product, seeds, sweep
from experiments.sweeps import arms

# Shortened relative to the main job (configs/countdown.py): fewer RL steps and a smaller held-out set.
QUICK = {"rl.mode": "emulate", "rl.steps": 80, "task.eval_size": 64, "eval_every": 10, "checkpoint_every": 20}


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, lags=[0, 64], arms=["no_correction", "seq_tis", "vcpo"], seeds=1, lr=2e-4)
  return product(arms.arms(a["arms"], a["lr"]), sweep("config.rl.max_lag", a["lags"]), fixed(QUICK),
                 seeds(a["seeds"]))
