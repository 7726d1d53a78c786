"""Checkpoints: round trip of state + host JSON; a full disk is reported and the previous checkpoint survives."""
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from vcpo_jax.job import checkpointing


def test_round_trip_and_latest(tmp_path):
  ck = checkpointing.Checkpointer(str(tmp_path / "ck"), max_to_keep=2)
  assert ck.restore({"a": jnp.zeros(3)}) is None
  for step in (1, 2, 3):
    assert ck.save(step, {"a": jnp.arange(3.0) * step, "n": jnp.int32(step)}, {"data": {"next_index": step}})
  step, state, host = ck.restore(checkpointing.abstract_like({"a": jnp.zeros(3), "n": jnp.int32(0)}))
  assert step == 3 and host == {"data": {"next_index": 3}}
  np.testing.assert_array_equal(state["a"], [0.0, 3.0, 6.0])
  assert ck.latest_step() == 3


@pytest.fixture
def tiny_disk(tmp_path):
  mount = tmp_path / "disk"
  mount.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                    capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here (needs root)")
  yield mount
  subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.integration
def test_full_disk_is_reported_and_previous_checkpoint_stays_usable(tiny_disk):
  ck = checkpointing.Checkpointer(str(tiny_disk / "ck"))
  small = {"w": jnp.ones((8,), jnp.float32)}
  assert ck.save(1, small, {"step": 1})
  big = {"w": jnp.asarray(np.random.RandomState(0).randn(1 << 20), jnp.float32)}  # 4 MiB, incompressible
  assert not ck.save(2, big, {"step": 2})
  assert ck.failed_saves == 1
  step, state, host = checkpointing.Checkpointer(str(tiny_disk / "ck")).restore(
      checkpointing.abstract_like(small))
  assert step == 1 and host == {"step": 1}
  np.testing.assert_array_equal(state["w"], np.ones(8))
