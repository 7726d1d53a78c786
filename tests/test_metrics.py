"""The TensorBoard writer: scalars and histograms read back from the event file; no torch import."""
import glob
import importlib.util
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from vcpo_jax.job.metrics import MetricsWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _events(logdir):
  """Every Event in the run's one event file (TFRecord framing: length, its crc, data, its crc)."""
  (path,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
  data, events, at = open(path, "rb").read(), [], 0
  while at < len(data):
    (n,) = struct.unpack("<Q", data[at:at + 8])
    events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + n]))
    at += 12 + n + 4
  return events


def test_scalars_and_histograms_read_back(tmp_path):
  writer = MetricsWriter(str(tmp_path))
  writer.write(3, {"loss": np.float32(0.5), "eval/pass@4": 0.25, "nan": float("nan"),
                   "hist/w": np.array([1.0, 2.0, np.inf, 4.0])}, prefix="train/")
  writer.close()
  values = {(e.step, v.tag): v for e in _events(str(tmp_path)) for v in e.summary.value}
  assert values[(3, "train/loss")].simple_value == 0.5
  assert values[(3, "train/eval/pass_4")].simple_value == 0.25  # '@' is not a TensorBoard tag character
  assert (3, "train/nan") not in values  # a non-finite scalar is not written
  histo = values[(3, "train/w")].histo  # the non-finite entry dropped
  assert (histo.num, histo.min, histo.max, histo.sum) == (3, 1.0, 4.0, 7.0)


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed here")
def test_the_job_does_not_import_torch():
  # tensorboardX would import torch (~1.7 s of every job's start-up) to accept tensors the job never logs.
  code = "import sys, vcpo_jax.main, vcpo_jax.serving.server; print(sorted({'torch'} & set(sys.modules)))"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
  assert out.strip() == "[]"
