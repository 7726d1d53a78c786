"""C5: real asynchrony, the learner on one core and the embedded server on another.

`--config=experiments/studies/claims/config.py:trace --sweep=experiments/studies/wallclock/sweep.py --parallel=1` (defaults:
lr=7e-05,steps=150,lags=2+4,seeds=3,first_seed=0,server_cpus=1: seeds 0-2; `first_seed=6` runs seeds 6-8, to
check the verdict with seeds it never used). One unit at a time: the launcher pins the unit (its learner) to the
first CPU it may use and `rollout.server_cpus` confines the embedded server to another, so the two stop
sharing cores and asynchrony has idle time to fill. Modes: sync (k = 0, the study's sync arm) and VCPO at k = 2
and 4 (the study's VCPO arm), over real HTTP rollouts (`rl.mode=http`), seed-major so a cut-short run keeps
whole seeds. experiments/stats/verdicts.py (c5) holds the pre-registered rule; `python -m experiments.studies.wallclock.page --root=...`
applies it. Run it on an otherwise idle machine: the verdict is about wall-clock time.
"""
from experiments.launch.sweep import chain, fixed, parse_arg, product, sweep
from experiments.studies.claims.sweeps import arms
from experiments.studies.claims.sweeps.claims_k8 import EVAL


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, lr=7e-5, steps=150, lags=[2, 4], seeds=3, first_seed=0, server_cpus="1")
  sync = product(arms.arms(["sync"], a["lr"]), fixed({"rl.max_lag": 0}))
  asynchronous = product(arms.arms(["vcpo"], a["lr"], opob_is_weight="reference"),
                         sweep("config.rl.max_lag", a["lags"]))
  seeds = range(a["first_seed"], a["first_seed"] + a["seeds"])
  units = chain(*(product(chain(sync, asynchronous), sweep("config.seed", [s])) for s in seeds))
  return product(units, fixed({"rl.mode": "http", "rollout.server_cpus": a["server_cpus"], "rl.steps": a["steps"],
                               **EVAL}))
