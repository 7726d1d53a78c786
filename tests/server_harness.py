"""The embedded server of tests/test_server_*.py: its model, its process and the model's own reference outputs."""
import concurrent.futures
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import waits
from tests import xla_env
from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf, hf_export
from vcpo_jax.model import tokenizer
from vcpo_jax.model import transformer as model
from vcpo_jax.rollout.servers import launcher

CFG = model_config.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8, max_seq_len=320)
PROMPT = [10, 11, 12, 13, 14]
LONG = 250  # tokens of the "long" generations that pause/abort/update interrupt
PAD_T = 320


def export(params_seed: int, out_dir: str):
  params = model.init_params(CFG, jax.random.PRNGKey(params_seed))
  # Sharper than the init: outputs differ between weights and sampling is far from uniform.
  params = jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 else x, params)
  hf_export.export_hf(params, CFG, out_dir, tokenizer.build_tokenizer())


class Server:
  def __init__(self, url, proc, dirs, log_path):
    self.url, self.proc, self.dirs, self.log_path = url, proc, dirs, log_path
    self.params = {name: hf.import_hf(d)[0] for name, d in dirs.items() if name in ("m0", "m1")}

  def call(self, method, path, body=None, timeout=120):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(self.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(req, timeout=timeout) as r:
        status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
      status, raw = e.code, e.read()
    try:
      return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
      return status, raw.decode()

  def generate(self, body, status=200):
    got, out = self.call("POST", "/generate", body)
    assert got == status, out
    return out

  def info(self):
    return self.call("GET", "/get_model_info")[1]

  def use_weights(self, name, version, **extra):
    status, out = self.call("POST", "/update_weights_from_disk",
                            {"model_path": self.dirs[name], "weight_version": version, **extra})
    assert status == 200 and out["success"], out


def serve(tmp_path_factory):
  """The server on loopback over three exported weights (m0 served, m1 and one outside its weights root), stopped
  when the generator closes: tests/conftest.py's session fixture `server`."""
  root = tmp_path_factory.mktemp("weights")
  dirs = {"m0": str(root / "m0"), "m1": str(root / "m1"),
          "outside": str(tmp_path_factory.mktemp("elsewhere") / "m2")}
  export(0, dirs["m0"])
  export(1, dirs["m1"])
  export(2, dirs["outside"])
  port = launcher.free_port()
  log_path = root.parent / "server.log"
  env = dict(os.environ, XLA_FLAGS=xla_env.xla_flags())
  cmd = [sys.executable, "-m", "vcpo_jax.serving.server", "--model-path", dirs["m0"], "--port", str(port),
         "--weights-root", str(root), "--max-prompt-len", "260", "--context-length", "302",
         # One shape for every test (8 rows, 16 prompt slots, 256 new slots): one jit compile.
         "--min-batch-bucket", "8", "--min-new-bucket", "256", "--max-batch", "8",
         # One token per chunk: long generations last long enough to be interrupted mid-way.
         "--chunk-steps", "1", "--batch-window-ms", "20"]
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
  srv = Server(f"http://127.0.0.1:{port}", proc, dirs, log_path)

  def healthy():
    if proc.poll() is not None:
      pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
    try:
      return srv.call("GET", "/health", timeout=2)[0] == 200
    except OSError:
      return False

  try:
    waits.wait_until(healthy, 120, "the server's /health", interval_s=0.2)
  except AssertionError as e:
    proc.kill()
    pytest.fail(f"{e}:\n{log_path.read_text()}")
  yield srv
  proc.terminate()
  try:
    proc.wait(timeout=20)
  except subprocess.TimeoutExpired:
    proc.kill()
    waits.wait_process(proc, 30, "the killed server to exit")


@jax.jit
def ref_logits(params, tokens_BxT):
  return model.forward(params, CFG, tokens_BxT)


def padded(seq):
  return jnp.asarray(np.array([list(seq) + [0] * (PAD_T - len(seq))], np.int32))


def ref_logprobs(params, prompt, output):
  """The learner's recompute: model.token_logprobs over prompt + output, right-padded."""
  tokens = padded(list(prompt) + list(output))
  lp = np.asarray(model.token_logprobs(params, CFG, tokens, jnp.ones_like(tokens)))
  return lp[0, len(prompt):len(prompt) + len(output)]


def ref_greedy(params, prompt, n):
  seq = list(prompt)
  for _ in range(n):
    seq.append(int(np.argmax(np.asarray(ref_logits(params, padded(seq)))[0, len(seq) - 1])))
  return seq[len(prompt):]


def long_request(srv, rid, seed=5):
  body = {"input_ids": PROMPT, "rid": rid, "return_logprob": True,
          "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "sampling_seed": seed}}
  pool = concurrent.futures.ThreadPoolExecutor(1)
  fut = pool.submit(srv.generate, body)
  pool.shutdown(wait=False)
  start = srv.info()["num_generated_tokens"]

  def first_token_out():
    assert not fut.done(), "the long request finished before its first token was seen"
    return srv.info()["num_generated_tokens"] - start >= 1

  waits.wait_until(first_token_out, 60, "the long request's first token", interval_s=0.005)
  return fut


def spans_and_prefix_logprobs(server, out, old="v0"):
  meta = out["meta_info"]
  spans = meta["weight_versions"]
  k = spans[0]["end"]
  np.testing.assert_allclose([e[0] for e in meta["output_token_logprobs"][:k]],
                             ref_logprobs(server.params["m0"], PROMPT, out["output_ids"][:k]),
                             atol=1e-5, rtol=0)
  assert spans[0]["version"] == old
  return spans
