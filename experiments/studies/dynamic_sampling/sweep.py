"""Dynamic sampling on the dataset demo, with vs without, 3 seeds (pre-registered; the rule is in page.py).

`python -m experiments.launch --config=configs/dataset.py:demo --sweep=experiments/studies/dynamic_sampling/sweep.py
--root=ROOT --parallel=1` (defaults: steps=100,seeds=3,first_seed=0,eval_every=10), then
`python -m experiments.studies.dynamic_sampling.page ROOT --out docs/results/dynamic_sampling`.
Arms: `off` (the demo as it is: asynchronous HTTP rollouts at k = 2, GRPO-family OPOB advantages) and `on`
(rl.dynamic_sampling.enabled, its default tolerance and cap); nothing else differs, overlong shaping stays off
so the comparison isolates the filter. Seed-major, so a study cut short keeps whole pairs; a seed's two runs
share its warm start. Both arms run the same number of steps: the filter's arm generates more tokens per step,
and the page compares the arms at the generated-token budget every run reached. Budget: ~3 h of one machine
(the demo's RL took 7-15 min a run on 2 CPU cores, docs/results/data_demo; the filter's arm generates more).
"""
from experiments.launch.sweep import arm, chain, fixed, parse_arg, product, sweep

ARMS = (("off", False), ("on", True))


def get_sweep(arg: str = "") -> list[dict]:
  a = parse_arg(arg, steps=100, seeds=3, first_seed=0, eval_every=10)
  arms = chain(*(arm(name, {"rl.dynamic_sampling.enabled": enabled}) for name, enabled in ARMS))
  seeds = range(a["first_seed"], a["first_seed"] + a["seeds"])
  units = chain(*(product(arms, sweep("config.seed", [s])) for s in seeds))
  return product(units, fixed({"rl.steps": a["steps"], "eval_every": a["eval_every"],
                               "checkpoint_every": a["eval_every"]}))
