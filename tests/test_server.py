"""The embedded SGLang-protocol server as a real process on loopback, checked against the model itself."""
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import waits
from tests import xla_env
from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf, hf_export
from vcpo_jax.model import tokenizer
from vcpo_jax.model import transformer as model
from vcpo_jax.rollout.servers import launcher

pytestmark = pytest.mark.integration

CFG = model_config.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8, max_seq_len=320)
PROMPT = [10, 11, 12, 13, 14]
LONG = 250  # tokens of the "long" generations that pause/abort/update interrupt
PAD_T = 320


def _export(params_seed: int, out_dir: str):
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  root = tmp_path_factory.mktemp("weights")
  dirs = {"m0": str(root / "m0"), "m1": str(root / "m1"),
          "outside": str(tmp_path_factory.mktemp("elsewhere") / "m2")}
  _export(0, dirs["m0"])
  _export(1, dirs["m1"])
  _export(2, dirs["outside"])
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
def _ref_logits(params, tokens_BxT):
  return model.forward(params, CFG, tokens_BxT)


def _padded(seq):
  return jnp.asarray(np.array([list(seq) + [0] * (PAD_T - len(seq))], np.int32))


def _ref_logprobs(params, prompt, output):
  """The learner's recompute: model.token_logprobs over prompt + output, right-padded."""
  tokens = _padded(list(prompt) + list(output))
  lp = np.asarray(model.token_logprobs(params, CFG, tokens, jnp.ones_like(tokens)))
  return lp[0, len(prompt):len(prompt) + len(output)]


def _ref_greedy(params, prompt, n):
  seq = list(prompt)
  for _ in range(n):
    seq.append(int(np.argmax(np.asarray(_ref_logits(params, _padded(seq)))[0, len(seq) - 1])))
  return seq[len(prompt):]


def _long_request(srv, rid, seed=5):
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


def test_health_info_and_routes(server):
  assert server.call("GET", "/health")[0] == 200
  assert server.call("GET", "/health_generate")[0] == 200
  info = server.info()
  assert info["weight_version"] == "v0" and info["vocab_size"] == 128
  with open(os.path.join(server.dirs["m0"], "generation_config.json")) as f:
    eos = json.load(f)["eos_token_id"]
  assert set(info["eos_token_ids"]) == set([eos] if isinstance(eos, int) else eos) != set()
  assert server.call("GET", "/flush_cache")[0] == 200 and server.call("POST", "/flush_cache")[0] == 200
  assert server.call("GET", "/no_such_route") == (404, {"detail": "Not Found"})


def test_single_greedy_matches_model(server):
  out = server.generate({"input_ids": PROMPT, "return_logprob": True,
                         "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
  params = server.params["m0"]
  assert out["output_ids"] == _ref_greedy(params, PROMPT, 12)
  meta = out["meta_info"]
  assert meta["finish_reason"] == {"type": "length", "length": 12}
  assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 12, 0)
  assert meta["weight_version"] == "v0"
  assert meta["weight_versions"] == [{"version": "v0", "start": 0, "end": 12}]
  assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
  assert all(e[2] is None for e in meta["output_token_logprobs"])
  np.testing.assert_allclose([e[0] for e in meta["output_token_logprobs"]],
                             _ref_logprobs(params, PROMPT, out["output_ids"]), atol=1e-5, rtol=0)
  assert out["text"] == tokenizer.build_tokenizer().decode(out["output_ids"], skip_special_tokens=True)


def test_text_batch_n_and_seeds(server):
  tok = tokenizer.build_tokenizer()
  texts = ["Compute 3+4", "Using the numbers"]
  outs = server.generate({"text": texts, "rid": ["a", "b"], "return_logprob": True, "logprob_start_len": 0,
                          "sampling_params": {"max_new_tokens": 8, "n": 2, "sampling_seed": 7,
                                              "ignore_eos": True}})
  assert [o["meta_info"]["id"] for o in outs] == ["a-0", "a-1", "b-0", "b-1"]  # prompt-major
  params = server.params["m0"]
  for i, o in enumerate(outs):
    prompt = tok.encode(texts[i // 2])
    meta = o["meta_info"]
    assert meta["prompt_tokens"] == len(prompt) and len(o["output_ids"]) == 8
    np.testing.assert_allclose([e[0] for e in meta["output_token_logprobs"]],
                               _ref_logprobs(params, prompt, o["output_ids"]), atol=1e-5, rtol=0)
    inputs = meta["input_token_logprobs"]
    assert [e[1] for e in inputs] == prompt and inputs[0][0] is None
    full = np.asarray(model.token_logprobs(params, CFG, _padded(prompt), jnp.ones((1, PAD_T), jnp.int32)))
    np.testing.assert_allclose([e[0] for e in inputs[1:]], full[0, 1:len(prompt)], atol=1e-5, rtol=0)
  assert outs[0]["output_ids"] != outs[1]["output_ids"]  # two samples, two random streams
  # Sample j of a seeded request is reproducible; n=1 is sample 0.
  single = server.generate({"text": texts[0], "sampling_params": {"max_new_tokens": 8, "sampling_seed": 7,
                                                                   "ignore_eos": True}})
  assert isinstance(single, dict) and single["output_ids"] == outs[0]["output_ids"]
  again = server.generate({"input_ids": [tok.encode(t) for t in texts],
                           "sampling_params": [{"max_new_tokens": 8, "n": 2, "sampling_seed": 7,
                                                "ignore_eos": True}] * 2})
  assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
  other = server.generate({"text": texts[0], "sampling_params": {"max_new_tokens": 8, "sampling_seed": 8,
                                                                  "ignore_eos": True}})
  assert other["output_ids"] != single["output_ids"]


def test_stop_ids_stop_strings_and_trim(server):
  tok = tokenizer.build_tokenizer()
  free = server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                   "ignore_eos": True}})["output_ids"]
  stop_id = free[4]
  cut = free.index(stop_id) + 1
  sp = {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_id]}
  trimmed = server.generate({"input_ids": PROMPT, "sampling_params": sp})
  kept = server.generate({"input_ids": PROMPT, "sampling_params": {**sp, "no_stop_trim": True}})
  assert trimmed["output_ids"] == kept["output_ids"] == free[:cut]
  assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
  assert kept["text"] == tok.decode(free[:cut], skip_special_tokens=True)
  assert trimmed["text"] == tok.decode(free[:cut - 1], skip_special_tokens=True)
  # A stop string: the output ends at the first token whose text completes it.
  text = tok.decode(free, skip_special_tokens=False)
  stop = text[len(text) // 2:len(text) // 2 + 2]
  by_str = server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                     "ignore_eos": True, "stop": [stop]}})
  ids = by_str["output_ids"]
  assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
  assert ids == free[:len(ids)] and stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])
  assert stop not in by_str["text"]
  capped = server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                     "ignore_eos": True}})
  assert capped["output_ids"] == free[:3]


@pytest.mark.parametrize("body,needle", [
    ({"input_ids": PROMPT, "sampling_params": {"bogus_key": 1}}, "unknown field `bogus_key`"),
    ({"input_ids": PROMPT, "bogus_top": 1}, "unknown field `bogus_top`"),
    ({"input_ids": [1, 128]}, "input_ids[1]=128"),
    ({"input_ids": [[1, 2], [3, -1]]}, "input_ids[1][1]=-1"),
    # 260: room for the client's resumed prompt (prompt + partial output) however late an abort lands.
    ({"input_ids": [1] * 261}, "max_prompt_len=260"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0"),
    ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"sampling_params": {}}, "input_ids"),
    (b"{not json", "JSON"),
])
def test_bad_requests_are_400_naming_the_field(server, body, needle):
  status, out = server.call("POST", "/generate", body)
  assert status == 400
  message = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
  assert needle in message


def test_update_weights_changes_outputs_and_version(server):
  greedy = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
  before = server.generate(greedy)
  status, out = server.call("POST", "/update_weights_from_disk",
                            {"model_path": server.dirs["outside"], "weight_version": "bad"})
  assert status == 400 and out["success"] is False and "outside the weights root" in out["message"]
  status, out = server.call("POST", "/update_weights_from_disk",
                            {"model_path": server.dirs["m0"] + "/../nope", "weight_version": "bad"})
  assert status == 400 and out["success"] is False
  assert server.info()["weight_version"] == "v0"
  try:
    server.use_weights("m1", "v1")
    after = server.generate(greedy)
    assert server.info()["weight_version"] == "v1"
    assert after["meta_info"]["weight_versions"] == [{"version": "v1", "start": 0, "end": 10}]
    assert after["output_ids"] != before["output_ids"]
    assert after["output_ids"] == _ref_greedy(server.params["m1"], PROMPT, 10)
    np.testing.assert_allclose([e[0] for e in after["meta_info"]["output_token_logprobs"]],
                               _ref_logprobs(server.params["m1"], PROMPT, after["output_ids"]),
                               atol=1e-5, rtol=0)
  finally:
    server.use_weights("m0", "v0")


def _spans_and_prefix_logprobs(server, out, old="v0"):
  meta = out["meta_info"]
  spans = meta["weight_versions"]
  k = spans[0]["end"]
  np.testing.assert_allclose([e[0] for e in meta["output_token_logprobs"][:k]],
                             _ref_logprobs(server.params["m0"], PROMPT, out["output_ids"][:k]),
                             atol=1e-5, rtol=0)
  assert spans[0]["version"] == old
  return spans


def test_context_limits_are_sglangs(server):
  """context_length 302: prompt + output is silently capped at 300 ("length"), as SGLang does."""
  out = server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 296, "ignore_eos": True}})
  assert len(out["output_ids"]) == 295 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 295}


def test_update_with_flush_while_requests_run_is_sglangs_400(server):
  """SGLang 0.5.23: the default flush_cache with a request in flight answers 400 "cache was not flushed",
  yet the new weights ARE live (new tokens carry v1) while /get_model_info still reports v0."""
  fut = _long_request(server, "unflushed")
  try:
    assert server.call("POST", "/pause_generation", {"mode": "in_place"})[0] == 200
    status, out = server.call("POST", "/update_weights_from_disk",
                              {"model_path": server.dirs["m1"], "weight_version": "v1"})
    assert status == 400 and out["success"] is False and "cache was not flushed" in out["message"]
    assert server.info()["weight_version"] == "v0"
    assert server.call("POST", "/flush_cache")[0] == 400  # only when idle
  finally:
    assert server.call("POST", "/continue_generation", {})[0] == 200
  out = fut.result(timeout=120)
  assert [s["version"] for s in out["meta_info"]["weight_versions"]] == ["v0", "v1"]
  assert server.info()["weight_version"] == "v0" and server.call("POST", "/flush_cache")[0] == 200
  server.use_weights("m0", "v0")


def test_pause_in_place_update_continue_gives_two_spans(server):
  fut = _long_request(server, "straddle")
  try:
    status, out = server.call("POST", "/pause_generation", {"mode": "in_place"})
    assert status == 200 and out["num_paused_requests"] == 1
    held = server.info()["num_generated_tokens"]
    time.sleep(0.2)
    assert server.info()["num_generated_tokens"] == held and not fut.done()  # really paused
    server.use_weights("m1", "v1", flush_cache=False)
  finally:
    assert server.call("POST", "/continue_generation", {})[0] == 200
  out = fut.result(timeout=120)
  spans = _spans_and_prefix_logprobs(server, out)
  assert len(out["output_ids"]) == LONG and out["meta_info"]["finish_reason"]["type"] == "length"
  assert [s["version"] for s in spans] == ["v0", "v1"]
  assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < LONG and spans[1]["end"] == LONG
  server.use_weights("m0", "v0")


def test_retract_resumes_the_same_random_stream(server):
  plain = server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True,
                                                                    "sampling_seed": 9}})
  fut = _long_request(server, "retracted", seed=9)
  try:
    assert server.call("POST", "/pause_generation", {"mode": "retract"})[0] == 200
  finally:
    assert server.call("POST", "/continue_generation", {})[0] == 200
  out = fut.result(timeout=120)
  assert out["output_ids"] == plain["output_ids"]
  assert out["meta_info"]["weight_versions"] == [{"version": "v0", "start": 0, "end": LONG}]


def test_abort_returns_partial_output(server):
  fut = _long_request(server, "doomed")
  assert server.call("POST", "/abort_request", {"rid": "doomed"})[0] == 200
  out = fut.result(timeout=60)
  meta = out["meta_info"]
  assert meta["finish_reason"]["type"] == "abort"
  assert 0 < len(out["output_ids"]) < LONG
  assert len(meta["output_token_logprobs"]) == len(out["output_ids"]) == meta["completion_tokens"]
  _spans_and_prefix_logprobs(server, out)
  # Pause in abort mode aborts whatever is running, too.
  fut = _long_request(server, "doomed-too")
  try:
    assert server.call("POST", "/pause_generation", {"mode": "abort"})[0] == 200
    assert fut.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
  finally:
    server.call("POST", "/continue_generation", {})


def test_update_without_pause_waits_for_in_flight(server):
  fut = _long_request(server, "finish-first")
  try:
    server.use_weights("m1", "v1")
    out = fut.result(timeout=60)
    # Had the update not waited, the tail of the request would carry v1.
    assert out["meta_info"]["weight_versions"] == [{"version": "v0", "start": 0, "end": LONG}]
  finally:
    server.use_weights("m0", "v0")


def test_request_joins_while_another_decodes(server):
  """Continuous batching: a short request submitted mid-way through a long one finishes before it, with the
  tokens and log-probs it gets alone (a windowed engine would hold it until the long batch drained)."""
  short = {"input_ids": PROMPT[:3], "return_logprob": True,
           "sampling_params": {"max_new_tokens": 6, "sampling_seed": 3, "ignore_eos": True, "temperature": 0.8}}
  alone = server.generate(short)
  fut = _long_request(server, "ongoing")
  try:
    joined = server.generate(short)
    assert not fut.done(), "the short request waited for the long one"
  finally:
    server.call("POST", "/abort_request", {"rid": "ongoing"})
  fut.result(timeout=60)
  assert joined["output_ids"] == alone["output_ids"]
  np.testing.assert_allclose([e[0] for e in joined["meta_info"]["output_token_logprobs"]],
                             [e[0] for e in alone["meta_info"]["output_token_logprobs"]], atol=1e-6, rtol=0)


def test_concurrent_requests_share_one_batch(server):
  before = server.info()["num_batches"]
  bodies = [{"input_ids": PROMPT[:i + 1], "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                              "ignore_eos": True}} for i in range(5)] * 2
  barrier = threading.Barrier(len(bodies))

  def send(body):
    barrier.wait(timeout=120)  # BrokenBarrierError, not a hang, if a sender never starts
    return server.generate(body)

  with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
    outs = list(pool.map(send, bodies))
  assert server.info()["max_batch_requests_seen"] > 1
  assert server.info()["num_batches"] - before < len(bodies)
  for body, out in zip(bodies, outs):  # batching does not change a row's result
    assert out["output_ids"] == _ref_greedy(server.params["m0"], body["input_ids"], 6)


def test_stream_sends_cumulative_events(server):
  body = {"input_ids": PROMPT, "stream": True,
          "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
  req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(), method="POST")
  with urllib.request.urlopen(req, timeout=60) as r:
    lines = [l.decode().strip() for l in r if l.strip()]
  assert lines[-1] == "data: [DONE]"
  events = [json.loads(l[len("data: "):]) for l in lines[:-1]]
  assert events[-1]["output_ids"] == _ref_greedy(server.params["m0"], PROMPT, 6)
  assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
  lengths = [len(e["output_ids"]) for e in events]
  assert lengths == sorted(lengths) and len(events) > 1


def test_bad_model_dir_exits_nonzero(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "vcpo_jax.serving.server", "--model-path", str(tmp_path),
                         "--port", str(launcher.free_port())], capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "cannot serve --model-path" in proc.stderr and "config.json" in proc.stderr


def test_rollout_client_against_embedded_server(server):
  """The project's client (abort-resume included) speaks to this server end to end."""
  import asyncio
  from vcpo_jax.rollout.client import client as client_lib

  async def run():
    async with client_lib.RolloutClient([server.url], vocab_size=128) as c:
      short = await c.generate(PROMPT, {"max_new_tokens": 8, "sampling_seed": 3, "ignore_eos": True}, n=2)
      start = (await asyncio.to_thread(server.info))["num_generated_tokens"]
      task = asyncio.create_task(
          c.generate(PROMPT, {"max_new_tokens": LONG, "sampling_seed": 4, "ignore_eos": True}))
      async def first_token_out():
        assert not task.done(), "the long request finished before its first token was seen"
        return (await asyncio.to_thread(server.info))["num_generated_tokens"] - start >= 1

      await waits.async_wait_until(first_token_out, 60, "the long request's first token", interval_s=0.005)
      assert (await asyncio.to_thread(server.call, "POST", "/abort_request", {"abort_all": True}))[0] == 200
      return short, (await waits.wait_for(task, 120, "the aborted request to resume and finish"))[0]

  short, resumed = asyncio.run(run())
  params = server.params["m0"]
  assert resumed.num_resumes >= 1 and len(resumed.output_ids) == LONG
  for s in short + [resumed]:
    assert s.finish_reason == "length" and set(s.token_versions.tolist()) == {0}
    np.testing.assert_allclose(s.output_logprobs, _ref_logprobs(params, PROMPT, s.output_ids),
                               atol=1e-5, rtol=0)


def test_prompt_scoring_text_in_logprobs_and_version_label(server):
  tok = tokenizer.build_tokenizer()
  out = server.generate({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 2,
                         "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 0}})
  meta = out["meta_info"]
  assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
  full = np.asarray(model.token_logprobs(server.params["m0"], CFG, _padded(PROMPT), jnp.ones((1, PAD_T))))
  assert [e[1] for e in meta["input_token_logprobs"]] == PROMPT[2:]
  assert [e[2] for e in meta["input_token_logprobs"]] == [tok.decode([t]) for t in PROMPT[2:]]
  np.testing.assert_allclose([e[0] for e in meta["input_token_logprobs"]], full[0, 2:len(PROMPT)],
                             atol=1e-5, rtol=0)
  try:
    status, out = server.call("POST", "/update_weight_version", {"new_version": "v9"})
    assert status == 200 and out["success"] and server.info()["weight_version"] == "v9"
    out = server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert out["meta_info"]["weight_versions"] == [{"version": "v9", "start": 0, "end": 2}]
  finally:
    server.call("POST", "/update_weight_version", {"new_version": "v0"})
