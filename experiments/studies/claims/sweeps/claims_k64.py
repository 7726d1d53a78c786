"""The first claims study (docs/results/study/README.md): every arm at k = 64, the lr controls, a lag sweep, seeds.

`--sweep=experiments/studies/claims/sweeps/claims_k64.py:seeds=3,k=64,lags=16,lag_arms=no_correction+seq_tis+vcpo,lr=0.0002,extra=0`
(defaults shown). Units are ordered by priority, seed-major inside each tier, so that a study cut short still
has whole seeds of the most important arms: (1) sync, the lr control nearest VCPO's measured mean lr scale,
no correction, seq-TIS and VCPO's components at k; (2) the other baselines at k; (3) the lag sweep; with
extra=1 also (4) the lower lr controls and lag 4 (the default is sized to what 2 cores run in ~2 h). Every
unit: lag emulation, 60 RL steps, 128 held-out problems evaluated every 10 steps, the main job otherwise.
With 60 steps a lag k >= 60 never binds: every batch comes from the warm-start policy (C4: sweeps/long.py).
"""
from experiments.launch.sweep import chain, fixed, parse_arg, product, sweep
from experiments.studies.claims.sweeps import arms

STUDY = {"rl.mode": "emulate", "rl.steps": 60, "task.eval_size": 128, "eval_every": 10, "checkpoint_every": 20}
TIER1 = ("no_correction", "seq_tis", "vcpo", "ess_only", "opob_only")
TIER2 = ("token_tis", "seq_mis", "ppo_decoupled", "m2po", "gspo", "cispo")


def _seed_major(sweep_of_seed, n: int):
  return chain(*(product(sweep_of_seed, sweep("config.seed", [s])) for s in range(n)))


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, seeds=3, k=64, lags=[16], lag_arms=["no_correction", "seq_tis", "vcpo"], lr=2e-4, extra=0)
  lr = a["lr"]
  sync = product(arms.arms(["sync"], lr), fixed({"rl.max_lag": 0}))
  at_k = lambda names: product(arms.arms(names, lr), fixed({"rl.max_lag": a["k"]}))  # noqa: E731
  tier1 = chain(sync, arms.lr_controls(lr, (0.5,)), at_k(TIER1))
  tier2 = at_k(TIER2)
  tier3 = product(arms.arms(a["lag_arms"], lr), sweep("config.rl.max_lag", a["lags"]))
  tier4 = chain(arms.lr_controls(lr, (0.25, 0.1)), product(arms.arms(a["lag_arms"], lr), fixed({"rl.max_lag": 4})))
  tiers = (tier1, tier2, tier3, tier4) if a["extra"] else (tier1, tier2, tier3)
  units = chain(*(_seed_major(t, a["seeds"]) for t in tiers))
  return product(units, fixed(STUDY))
