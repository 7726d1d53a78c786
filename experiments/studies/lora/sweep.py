"""The LoRA study's units (docs/results/lora/README.md), one part per launch:

  part=pilot[,lrs=5e-4+2e-3+8e-3,ranks=4+16]   LoRA at each lr x rank, seed first_seed, PILOT_STEPS steps
  part=main,lr=<pick>,rank=<pick>               full fine-tuning (FULL_LR) vs LoRA at the pilot's pick, SEEDS seeds

with `--config=experiments/studies/claims/config.py` (the CPU demo's model, warm start and algorithm, on
two-number Countdown in [1, 40] with the emulated rollout backend at the demo's k = 2). Seed-major, so a study
cut short keeps whole pairs; a seed's units (pilot and main, LoRA and full) share one cached warm start, since the
SFT warm start is full fine-tuning either way (docs/lora.md). LoRA's alpha stays at its default (32): the
scaling alpha / r then keeps the best learning rate roughly independent of the rank.
"""
from experiments.launch.sweep import arm, chain, fixed, name_units, parse_arg, product, sweep

CONFIG = "experiments/studies/claims/config.py"
FULL_LR = 2e-4                 # the setting's (configs/countdown.py optim.learning_rate)
PILOT_LRS = (5e-4, 2e-3, 8e-3)  # 2.5x, 10x and 40x FULL_LR ("LoRA without regret": ~10x)
PILOT_RANKS = (4, 16)
PILOT_STEPS = 100
MAIN_STEPS = 200
SEEDS = 5
EVAL_EVERY = 20
EVAL = {"eval_every": EVAL_EVERY, "checkpoint_every": EVAL_EVERY}
RANK_KEY = "model.lora.rank"
LR_KEY = "optim.learning_rate"


def lora_arm(name: str, lr: float, rank: int):
  return arm(name, {LR_KEY: lr, RANK_KEY: rank})


def _seed_major(units, seeds):
  return chain(*(product(units, sweep("config.seed", [s])) for s in seeds))


def _positive(name, values, kind=float):
  if not values or any(kind(v) != v or v <= 0 for v in values):
    raise ValueError(f"sweep argument {name}={values}: must be {kind.__name__}s > 0")


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, part="", lr=0.0, rank=0, lrs=PILOT_LRS, ranks=PILOT_RANKS, first_seed=0, seeds=SEEDS)
  s0 = a["first_seed"]
  if a["part"] == "pilot":
    _positive("lrs", a["lrs"])
    _positive("ranks", a["ranks"], int)
    grid = chain(*(product(lora_arm("pilot_lora", lr, rank), fixed({"seed": s0}))
                   for lr in a["lrs"] for rank in a["ranks"]))
    return name_units(product(grid, fixed({"rl.steps": PILOT_STEPS, **EVAL})))
  if a["part"] == "main":
    if a["lr"] <= 0 or a["rank"] <= 0:
      raise ValueError(f"sweep argument lr={a['lr']:g},rank={a['rank']}: part=main needs the pilot's pick "
                       "(lr=...,rank=...)")
    if a["seeds"] < 3:
      raise ValueError(f"sweep argument seeds={a['seeds']}: the study needs >= 3 seeds")
    arms = chain(arm("full", {LR_KEY: FULL_LR, RANK_KEY: 0}), lora_arm("lora", a["lr"], a["rank"]))
    units = _seed_major(arms, range(s0, s0 + a["seeds"]))
    return name_units(product(units, fixed({"rl.steps": MAIN_STEPS, **EVAL})))
  raise ValueError(f"sweep argument part={a['part']!r}: must be pilot or main")
