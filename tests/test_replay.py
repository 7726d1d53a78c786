"""job.replay: a lag-emulation run's params at a checkpoint and the batches its emulator trains on next."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import tiny_runs
from vcpo_jax.job import replay
from vcpo_jax.model import transformer as M
from vcpo_jax.rollout.emulation import ring_store

STEP, K = 3, 2

pytestmark = pytest.mark.slow  # a tiny model's generation and an orbax restore: seconds, not milliseconds


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("replay") / "run")
  params = tiny_runs.emulated_checkpoint(path, step=STEP, k=K)
  return path, params


def test_the_batches_come_from_the_version_k_steps_back(workdir):
  path, params = workdir
  run = replay.load_run(path)
  out = replay.replay(path, STEP, 2, run=run)
  assert out.step == STEP and len(out.batches) == 2
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(params)))
  rows = run.config.rl.prompts_per_step * run.config.rl.group_size
  first = out.batches[0]
  assert first.tokens_BxT.shape[0] == rows and np.all(first.lag_B == K)
  # The sampler's log-probs are those of the ring's version STEP - K (independent of the emulator: recomputed
  # here from the saved params), and not the learner's own.
  past = ring_store.RingStore(os.path.join(path, "emulation_ring")).load(STEP - K, like=params)
  mask = np.asarray(first.mask_BxT) > 0
  for source, close in ((past, True), (params, False)):
    logp = np.asarray(M.token_logprobs(source, out.model_cfg, jnp.asarray(first.tokens_BxT),
                                       jnp.asarray(first.mask_BxT)))
    assert np.allclose(logp[mask], np.asarray(first.sampler_logp_BxT)[mask], atol=1e-4) is close
  # The two batches are the run's next two steps' prompts, not one prompt drawn twice.
  assert not np.array_equal(out.batches[0].tokens_BxT, out.batches[1].tokens_BxT)


def test_a_replay_is_the_same_each_time_and_max_lag_is_the_fixed_models(workdir):
  path, _ = workdir
  run = replay.load_run(path)
  once = replay.replay(path, STEP, 1, run=run).batches[0]
  again = replay.replay(path, STEP, 1, lag=replay.MAX, run=run).batches[0]  # the run's model is 'fixed'
  assert np.array_equal(once.tokens_BxT, again.tokens_BxT) and np.array_equal(once.lag_B, again.lag_B)


def test_bad_requests_are_errors_naming_what_is_wrong(workdir, tmp_path):
  path, _ = workdir
  run = replay.load_run(path)
  with pytest.raises(ValueError, match=r"step=4: no checkpoint"):
    replay.replay(path, 4, 1, run=run)
  with pytest.raises(ValueError, match=r"lag='newest'"):
    replay.replay(path, STEP, 1, lag="newest", run=run)
  with pytest.raises(ValueError, match=r"batches=0"):
    replay.replay(path, STEP, 0, run=run)
  other = tmp_path / "http_run"
  other.mkdir()
  config = json.loads(open(os.path.join(path, "config.json")).read())
  config["rl"]["mode"] = "http"
  (other / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"rl.mode='http'"):
    replay.load_run(str(other))
  gone = tmp_path / "gone"
  os.makedirs(gone)
  tiny_runs.emulated_checkpoint(str(gone / "run"), step=STEP, k=K)
  os.remove(str(gone / "run" / "emulation_ring" / f"v{STEP - K}.npz"))
  with pytest.raises(LookupError, match=rf"version\(s\) \[{STEP - K}\]"):
    replay.replay(str(gone / "run"), STEP, 1)
