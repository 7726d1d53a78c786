"""The powered claims study at lag k = 8 (docs/results/study/README.md pre-registers its rules).

`--config=experiments/studies/claims/config.py --sweep=experiments/studies/claims/sweeps/claims_k8.py:lr=0.0004,steps=150,long_steps=384,c4_lags=32+128`
(defaults shown; lr 4e-4 is the pilot's choice; c4_lags=32 drops the k = 128 tier, the last and costliest). Units in priority order (C2 > C3 > C4), seed-major inside
each tier, so that a study cut short still has whole seeds of the most important arms:
  1. C2 and the preconditions, k = 8: sync (k = 0), no correction, seq-TIS, VCPO, seeds 0-3;
  2. the same minus no correction, seeds 4-5 (6 seeds for sync, seq-TIS and VCPO);
  3. C3, k = 8: ESS-only and OPOB-only, seeds 0-3;
  4. the VCPO variant with OPOB is_weight=truncated, k = 8, seeds 0-3 (reported, not deciding);
  5. C4: VCPO and seq-TIS at k = 32 (`steps` >= 3k steps, against the same sync runs), then `sync_long`
     (sync, `long_steps`), VCPO and seq-TIS at k = 128 (`long_steps` >= 3k), seeds 0-2.
VCPO and OPOB-only weight OPOB as the authors' code does (is_weight=reference: wt^2 w^2 ||s||^2).
C5 (real async, learner and server on separate cores) is not a lag-emulation unit: see the page.
The first study's units (k = 64, 60 steps) are experiments/studies/claims/sweeps/claims_k64.py, unchanged.
"""
from experiments.launch.sweep import arm, chain, fixed, parse_arg, product, sweep
from experiments.studies.claims.sweeps import arms

K = 8
C4_LAGS = (32, 128)
EVAL = {"task.eval_size": 512, "task.eval_samples": 4, "eval_every": 25, "checkpoint_every": 25}


def _seed_major(units, seeds):
  return chain(*(product(units, sweep("config.seed", [s])) for s in seeds))


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, lr=4e-4, steps=150, long_steps=384, c4_lags=list(C4_LAGS))
  short_lags = [k for k in a["c4_lags"] if 3 * k <= a["steps"]]   # C4 runs as long as the k = 8 ones
  long_lags = [k for k in a["c4_lags"] if 3 * k > a["steps"]]     # C4 runs of long_steps, with sync_long
  if any(3 * k > a["long_steps"] for k in long_lags):
    raise ValueError(f"C4 needs runs of >= 3k steps: long_steps={a['long_steps']} < 3 x {max(long_lags)}")
  table = lambda names, k: product(arms.arms(names, a["lr"], opob_is_weight="reference"),  # noqa: E731
                                   fixed({"rl.max_lag": k}))
  sync = product(arms.arms(["sync"], a["lr"]), fixed({"rl.max_lag": 0}))
  steps = fixed({"rl.steps": a["steps"]})
  tiers = [
      _seed_major(chain(sync, table(["no_correction", "seq_tis", "vcpo"], K)), range(4)),
      _seed_major(chain(sync, table(["seq_tis", "vcpo"], K)), range(4, 6)),
      _seed_major(table(["ess_only", "opob_only"], K), range(4)),
      _seed_major(table(["vcpo_truncated"], K), range(4)),
      *(_seed_major(table(["vcpo", "seq_tis"], k), range(3)) for k in short_lags),
  ]
  units = product(chain(*tiers), steps, fixed(EVAL))
  if long_lags:
    sync_long = product(arm("sync_long", arms.overrides(a["lr"])["sync"]), fixed({"rl.max_lag": 0}))
    long_tier = _seed_major(chain(sync_long, *(table(["vcpo", "seq_tis"], k) for k in long_lags)), range(3))
    units = chain(units, product(long_tier, fixed({"rl.steps": a["long_steps"]}), fixed(EVAL)))
  return units
