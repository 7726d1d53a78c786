"""C2 over the paper's horizon: the powered study's k = 8 setting run to 450 steps (docs/results/horizon/).

`--config=experiments/studies/claims/config.py:trace --sweep=experiments/studies/horizon/sweep.py --parallel=2`
(defaults: lr=7e-05,steps=450,c4_lag=32,first_seed=0; `first_seed=6` runs the same study on seeds 6-11, to check
its verdicts with seeds it never used; `extend=1+3` runs every unit of seeds 1 and 3 for steps + 150, the
page's rule for a sync seed that has not converged: a relaunch resumes those units from their last checkpoint,
under the same names; `tiers=1+3` keeps only those tiers, under the names the whole sweep gives them). Units in
priority order (C2 > C4), seed-major inside each tier, so a
study cut short keeps whole seeds of the arms that decide C2:
  1. k = 8: sync (k = 0), VCPO, ESS-only, seq-TIS, seeds 0-3 (counted from first_seed, as below);
  2. sync and VCPO, seeds 4-5;
  3. C4 at k = c4_lag: VCPO and seq-TIS, seeds 0-2 (against the same sync runs; 450 >= 3k steps).
VCPO weights OPOB as the authors' code does (is_weight=reference), as in the powered study; its runs log OPOB's
second-moment ratio every step (opob/moment_ratio).
"""
from experiments.launch.sweep import chain, fixed, name_units, parse_arg, product, sweep
from experiments.studies.claims.sweeps import arms

K = 8
EVAL = {"task.eval_size": 512, "task.eval_samples": 4, "eval_every": 25, "checkpoint_every": 25}
EXTEND_STEPS = 150


def _seed_major(units, seeds):
  return chain(*(product(units, sweep("config.seed", [s])) for s in seeds))


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, lr=7e-5, steps=450, c4_lag=32, extend=(), tiers=(1, 2, 3), first_seed=0)
  if 3 * a["c4_lag"] > a["steps"]:
    raise ValueError(f"C4 needs runs of >= 3k steps: steps={a['steps']} < 3 x c4_lag={a['c4_lag']}")
  sync = product(arms.arms(["sync"], a["lr"]), fixed({"rl.max_lag": 0}))
  table = lambda names, k: product(arms.arms(names, a["lr"], opob_is_weight="reference"),  # noqa: E731
                                   fixed({"rl.max_lag": k}))
  s0 = a["first_seed"]
  tiers = [
      _seed_major(chain(sync, table(["vcpo", "ess_only", "seq_tis"], K)), range(s0, s0 + 4)),
      _seed_major(chain(sync, table(["vcpo"], K)), range(s0 + 4, s0 + 6)),
      _seed_major(table(["vcpo", "seq_tis"], a["c4_lag"]), range(s0, s0 + 3)),
  ]
  keep = set(a["tiers"])
  if not keep <= {1, 2, 3}:
    raise ValueError(f"sweep argument tiers={'+'.join(map(str, a['tiers']))}: each tier must be 1, 2 or 3")
  # Named before the lengths differ or tiers are dropped, so that a unit's name never depends on either.
  units = name_units(product(chain(*tiers), fixed({"rl.steps": a["steps"]}), fixed(EVAL)))
  tier_of = [i + 1 for i, t in enumerate(tiers) for _ in t]
  units = [u for u, t in zip(units, tier_of) if t in keep]
  extend = {int(s) for s in a["extend"]}
  for u in units:
    if u["config.seed"] in extend:
      u["config.rl.steps"] = a["steps"] + EXTEND_STEPS
  return units
