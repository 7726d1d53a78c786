"""`make reproduce-quick`: 1 seed, 3 arms (no correction, seq-TIS, VCPO), k in {0, 64}, shortened to fit
<= 15 min on 2 cores. A smoke test of the whole pipeline, not evidence: one seed decides nothing.

Shortened relative to the main job (configs/countdown.py, otherwise unchanged: batch 16 prompts x 8 samples,
lr 2e-4, 200 SFT steps shared by all units): 60 RL steps instead of 100, 64 held-out problems instead of 128,
evaluated every 10 steps. With 60 steps the k = 64 cap never binds: every k = 64 batch is sampled by the
warm-start policy (lag = step), the most stale setting a 60-step run can have.
"""
from experiments.launch.sweep import fixed, parse_arg, product, seeds, sweep
from experiments.studies.claims.sweeps import arms

QUICK = {"rl.mode": "emulate", "rl.steps": 60, "task.eval_size": 64, "eval_every": 10, "checkpoint_every": 20}


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, lags=[0, 64], arms=["no_correction", "seq_tis", "vcpo"], seeds=1, lr=2e-4)
  return product(arms.arms(a["arms"], a["lr"]), sweep("config.rl.max_lag", a["lags"]), fixed(QUICK),
                 seeds(a["seeds"]))
