"""Writes the job's starting weights (the cached SFT warm start, WORKDIR/base) so servers can start on them.

  python -m vcpo_jax.job.export_base --config=configs/countdown.py --workdir=W [--config.x=y ...]

Real SGLang servers need a Hugging Face directory before the job runs; this is the job's own warm start
(cached: the job itself then skips it), with the same config flags. Start the servers on W/base with
WEIGHT_VERSION=v0, then run the job with the same --workdir and --config.rollout.server_urls.
"""
import os

from absl import app, flags, logging
from ml_collections import config_flags

from vcpo_jax.job import configuration, warm_start
from vcpo_jax.rollout.rewards import Rewarder

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (get_config()).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The job's workdir; the weights go to WORKDIR/base.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.INFO)
  config = _CONFIG.value
  model_cfg, tok, task, eval_examples = warm_start.starting_point(config)
  rewarder = Rewarder.for_task(task, tok, configuration.reward_config(config))
  try:
    base_dir, _ = warm_start.warm_start(config, os.path.abspath(_WORKDIR.value), model_cfg, tok, task, eval_examples,
                                        rewarder)
  finally:
    rewarder.close()
  print(base_dir)


if __name__ == "__main__":
  app.run(main)
