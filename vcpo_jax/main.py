"""Entry point: `python -m vcpo_jax.main --config=configs/countdown.py --workdir=W [--config.x=y ...]`."""
import faulthandler
import logging as pylogging
import os
import signal

from absl import app, flags, logging
from ml_collections import config_flags


from vcpo_jax.job import configuration, startup_errors
from vcpo_jax.job import train
from vcpo_jax.parallel import processes
from vcpo_jax.parallel import placement

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (get_config()).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, TensorBoard events and the base model.")
flags.mark_flags_as_required(["config", "workdir"])


class _QuietLibraries(pylogging.Filter):
  """Keeps our INFO lines; drops INFO chatter from orbax/jax/tensorboardX (their warnings still show)."""

  def filter(self, record):
    return record.levelno >= pylogging.WARNING or "/vcpo_jax/" in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # A config error is one line unless its traceback is asked for (--verbosity=1, or VCPO_TRACEBACK=1).
  traceback_wanted = logging.get_verbosity() >= 1 or bool(os.environ.get(startup_errors.TRACEBACK_VAR))
  logging.set_verbosity(max(logging.get_verbosity(), logging.INFO))
  logging.get_absl_handler().addFilter(_QuietLibraries())
  faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack (a stuck run)
  try:
    config = _CONFIG.value
    config.keys()  # a config file that failed to load raises on first use
  except OSError as e:
    startup_errors.exit_if_config_file_error(e, traceback_wanted)
    raise
  try:
    # Before JAX touches a device: on a GPU shared with embedded servers, no process preallocates most of it.
    placement.configure_learner(configuration.device_plan(config))
    processes.initialize(config.get("distributed"))  # before JAX touches a device; no-op for 1 process
    train.train_and_evaluate(config, _WORKDIR.value)
  except ValueError as e:
    startup_errors.exit_if_config_error(e, traceback_wanted)
    raise


if __name__ == "__main__":
  app.run(main, flags_parser=startup_errors.parse_flags)
