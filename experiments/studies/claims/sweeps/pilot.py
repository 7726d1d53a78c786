"""The calibration pilot: where does no correction degrade and sequence TIS get stressed?

`--config=experiments/studies/claims/config.py --sweep=experiments/studies/claims/sweeps/pilot.py:lrs=0.0001+0.0002+5e-05,k=8,steps=80,seeds=1`
(defaults shown). Per learning rate (in the order given): sync (k = 0), no correction and seq-TIS at k with the
pipeline lag model. What to read from it (experiments/studies/claims/pilot.py): the ESS ratio's median and dips, the
sequence KL between sampler and learner at lag k and per lag step, and each arm's accuracy vs sync.
"""
from experiments.launch.sweep import chain, fixed, parse_arg, product, sweep
from experiments.studies.claims.sweeps import arms

ARMS_AT_K = ("no_correction", "seq_tis")


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, lrs=[1e-4, 2e-4, 5e-5], k=8, steps=80, seeds=1)
  settings = fixed({"rl.steps": a["steps"], "eval_every": 20, "checkpoint_every": 20})
  per_lr = []
  for lr in a["lrs"]:
    sync = product(arms.arms(["sync"], lr), fixed({"rl.max_lag": 0}))
    at_k = product(arms.arms(ARMS_AT_K, lr), fixed({"rl.max_lag": a["k"]}))
    per_lr.append(chain(sync, at_k))
  return product(chain(*per_lr), sweep("config.seed", range(a["seeds"])), settings)
