"""The optimizer study's units (docs/results/optimizer/README.md), one part per launch:

  part=pilot[,lrs=0.01+0.03+0.1+0.3]  SGD sync, seed first_seed, PILOT_STEPS steps, one unit per lr
  part=sgd,lr=<the pilot's pick>      tier 1: SGD sync (k = 0), ESS-only and VCPO (k = 8), 4 seeds, SGD_STEPS
  part=opob_only                      tier 2: C3's OPOB-only arm under AdamW (lr 7e-5), k = 8, 4 seeds, 600 steps

with `--config=experiments/studies/claims/config.py:trace` (the horizon study's setting). first_seed=6 runs the same units
on seeds 6-9. Tiers 1 and 2 log the update diagnostics (algo.update_diagnostics); the pilot does not.
"""
from experiments.launch.sweep import arm, chain, fixed, name_units, parse_arg, product, sweep
from experiments.studies.claims.sweeps import arms
from experiments.studies.horizon.sweep import EVAL, K

PILOT_LRS = (0.01, 0.03, 0.1, 0.3)
PILOT_STEPS = 100
SGD_STEPS = 300
OPOB_ONLY_STEPS = 600    # the horizon study's C2 units, extended to 600 steps
ADAM_LR = 7e-5           # the horizon study's
SEEDS = 4
SGD = {"optim.name": "sgd", "optim.momentum": 0.9}
DIAGNOSTICS = {"algo.update_diagnostics": True}


def sgd_arms(lr: float, prefix: str = "sgd_"):
  """sync (k = 0), ESS-only and VCPO (k = 8) with SGD + momentum at lr, VCPO's OPOB as the horizon study's."""
  table = arms.overrides(lr, opob_is_weight="reference")
  return chain(arm(f"{prefix}sync", {**table["sync"], **SGD, "rl.max_lag": 0}),
               *(arm(f"{prefix}{name}", {**table[name], **SGD, "rl.max_lag": K}) for name in ("ess_only", "vcpo")))


def _seed_major(units, seeds):
  return chain(*(product(units, sweep("config.seed", [s])) for s in seeds))


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, part="", lr=0.0, lrs=PILOT_LRS, first_seed=0)
  s0 = a["first_seed"]
  if a["part"] == "pilot":
    if not a["lrs"] or any(lr <= 0 for lr in a["lrs"]):
      raise ValueError(f"sweep argument lrs={a['lrs']}: the pilot needs learning rates > 0")
    units = chain(*(product(arm("pilot_sgd_sync", {**arms.overrides(lr)["sync"], **SGD, "rl.max_lag": 0}),
                            fixed({"seed": s0})) for lr in a["lrs"]))
    return name_units(product(units, fixed({"rl.steps": PILOT_STEPS}), fixed(EVAL)))
  if a["part"] == "sgd":
    if a["lr"] <= 0:
      raise ValueError(f"sweep argument lr={a['lr']}: part=sgd needs the pilot's learning rate (lr=...)")
    units = _seed_major(sgd_arms(a["lr"]), range(s0, s0 + SEEDS))
    return name_units(product(units, fixed({"rl.steps": SGD_STEPS, **DIAGNOSTICS}), fixed(EVAL)))
  if a["part"] == "opob_only":
    only = product(arms.arms(["opob_only"], ADAM_LR, opob_is_weight="reference"), fixed({"rl.max_lag": K}))
    units = _seed_major(only, range(s0, s0 + SEEDS))
    return name_units(product(units, fixed({"rl.steps": OPOB_ONLY_STEPS, **DIAGNOSTICS}), fixed(EVAL)))
  raise ValueError(f"sweep argument part={a['part']!r}: must be pilot, sgd or opob_only")
