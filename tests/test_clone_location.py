"""Where the clone lives does not matter: the sandbox's escape checks pass from a copy under /tmp whose path has
a space (the sandbox hides /tmp behind a tmpfs of its own, so a clone there is a case of its own)."""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What `python -m pytest tests/test_sandbox.py` needs from a checkout.
COPIED = ("vcpo_jax", "pyproject.toml", "tests/conftest.py", "tests/calibration.py", "tests/timing_plugin.py",
          "tests/test_sandbox.py")
ESCAPES = ("writes_outside or no_connection or killing_its_parent or environment_is_not_readable or "
           "leaves_the_group or dies_with_its_caller or fork_bomb or under_tmp")


def test_sandbox_escape_checks_pass_from_a_copy_under_tmp_with_a_space():
  clone = tempfile.mkdtemp(dir="/tmp", prefix="vcpo clone ")
  try:
    for path in COPIED:
      source, target = os.path.join(ROOT, path), os.path.join(clone, path)
      os.makedirs(os.path.dirname(target), exist_ok=True)
      if os.path.isdir(source):
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
      else:
        shutil.copy(source, target)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_XDIST_WORKER")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                        "tests/test_sandbox.py", "-k", ESCAPES],
                       cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]
    # The copy's package was the one tested, not the checkout's.
    which = subprocess.run([sys.executable, "-c", "import vcpo_jax.tasks.environments.sandbox as s; print(s.__file__)"],
                           cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    assert which.stdout.strip().startswith(os.path.join(clone, "vcpo_jax")), which.stdout + which.stderr
  finally:
    shutil.rmtree(clone, ignore_errors=True)
