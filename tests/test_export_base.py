"""export_base writes the job's own starting point: with model.hf_path, the checkpoint's tokenizer and weights."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from vcpo_jax.model import hf
from vcpo_jax.model import tokenizer as tokenizer_lib

pytest.importorskip("transformers")
from tests import xla_env  # noqa: E402
from test_pretrained import TEXTS, build_checkpoint  # noqa: E402  (needs transformers)

pytestmark = [pytest.mark.slow]  # one export_base process (~25 s on CPU)

_CONFIG = """
from configs import tiny


def get_config():
  c = tiny.get_config()
  for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "tie_word_embeddings"):  # the checkpoint's architecture
    del c.model[field]
  c.model.hf_path = {ckpt!r}
  c.model.max_seq_len = 256
  c.sft.steps = 0  # the exported weights are then the checkpoint's
  c.task.eval_size = 2
  c.rl.max_new_tokens = 4
  return c
"""


def test_export_base_with_hf_path_writes_the_pretrained_tokenizer_and_weights(tmp_path):
  ckpt = build_checkpoint(str(tmp_path / "ckpt"))
  config_file = tmp_path / "pretrained_config.py"
  config_file.write_text(_CONFIG.format(ckpt=ckpt))
  env = dict(os.environ, VCPO_PROGRESS="0", JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = xla_env.xla_flags()
  proc = subprocess.run([sys.executable, "-m", "vcpo_jax.job.export_base", f"--config={config_file}",
                         f"--workdir={tmp_path / 'work'}"], capture_output=True, text=True, env=env, timeout=300,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert proc.returncode == 0, proc.stderr[-3000:]
  base = proc.stdout.strip().splitlines()[-1]
  assert base == str(tmp_path / "work" / "base")
  exported, pretrained = tokenizer_lib.load_pretrained(base), tokenizer_lib.load_pretrained(ckpt)
  assert exported.vocab_size == pretrained.vocab_size
  for text in TEXTS:
    assert exported.encode(text) == pretrained.encode(text), text
  assert exported.chat_prompt("Compute 2 + 2.") == pretrained.chat_prompt("Compute 2 + 2.")
  assert exported.stop_ids == pretrained.stop_ids
  for ours, theirs in zip(jax.tree.leaves(hf.import_hf(base)[0]), jax.tree.leaves(hf.import_hf(ckpt)[0])):
    np.testing.assert_array_equal(ours, theirs)
