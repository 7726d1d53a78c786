"""The embedded SGLang-protocol server as a real process on loopback: its routes, requests, sampling, batching and
streams, checked against the model itself."""
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

from tests.server_harness import CFG, PAD_T, PROMPT, long_request, padded, ref_greedy, ref_logprobs
from vcpo_jax.model import tokenizer
from vcpo_jax.model import transformer as model
from vcpo_jax.rollout.servers import launcher

pytestmark = pytest.mark.integration  # every test here talks to (or starts) a server process


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
  assert out["output_ids"] == ref_greedy(params, PROMPT, 12)
  meta = out["meta_info"]
  assert meta["finish_reason"] == {"type": "length", "length": 12}
  assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 12, 0)
  assert meta["weight_version"] == "v0"
  assert meta["weight_versions"] == [{"version": "v0", "start": 0, "end": 12}]
  assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
  assert all(e[2] is None for e in meta["output_token_logprobs"])
  np.testing.assert_allclose([e[0] for e in meta["output_token_logprobs"]],
                             ref_logprobs(params, PROMPT, out["output_ids"]), atol=1e-5, rtol=0)
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
                               ref_logprobs(params, prompt, o["output_ids"]), atol=1e-5, rtol=0)
    inputs = meta["input_token_logprobs"]
    assert [e[1] for e in inputs] == prompt and inputs[0][0] is None
    full = np.asarray(model.token_logprobs(params, CFG, padded(prompt), jnp.ones((1, PAD_T), jnp.int32)))
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


def test_context_limits_are_sglangs(server):
  """context_length 302: prompt + output is silently capped at 300 ("length"), as SGLang does."""
  out = server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 296, "ignore_eos": True}})
  assert len(out["output_ids"]) == 295 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 295}


def test_prompt_scoring_text_in_logprobs_and_version_label(server):
  tok = tokenizer.build_tokenizer()
  out = server.generate({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 2,
                         "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 0}})
  meta = out["meta_info"]
  assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
  full = np.asarray(model.token_logprobs(server.params["m0"], CFG, padded(PROMPT), jnp.ones((1, PAD_T))))
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
    assert out["output_ids"] == ref_greedy(server.params["m0"], body["input_ids"], 6)


def test_request_joins_while_another_decodes(server):
  """Continuous batching: a short request submitted mid-way through a long one finishes before it, with the
  tokens and log-probs it gets alone (a windowed engine would hold it until the long batch drained)."""
  short = {"input_ids": PROMPT[:3], "return_logprob": True,
           "sampling_params": {"max_new_tokens": 6, "sampling_seed": 3, "ignore_eos": True, "temperature": 0.8}}
  alone = server.generate(short)
  fut = long_request(server, "ongoing")
  try:
    joined = server.generate(short)
    assert not fut.done(), "the short request waited for the long one"
  finally:
    server.call("POST", "/abort_request", {"rid": "ongoing"})
  fut.result(timeout=60)
  assert joined["output_ids"] == alone["output_ids"]
  np.testing.assert_allclose([e[0] for e in joined["meta_info"]["output_token_logprobs"]],
                             [e[0] for e in alone["meta_info"]["output_token_logprobs"]], atol=1e-6, rtol=0)


def test_stream_sends_cumulative_events(server):
  body = {"input_ids": PROMPT, "stream": True,
          "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
  req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(), method="POST")
  with urllib.request.urlopen(req, timeout=60) as r:
    lines = [l.decode().strip() for l in r if l.strip()]
  assert lines[-1] == "data: [DONE]"
  events = [json.loads(l[len("data: "):]) for l in lines[:-1]]
  assert events[-1]["output_ids"] == ref_greedy(server.params["m0"], PROMPT, 6)
  assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
  lengths = [len(e["output_ids"]) for e in events]
  assert lengths == sorted(lengths) and len(events) > 1


def test_bad_model_dir_exits_nonzero(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "vcpo_jax.serving.server", "--model-path", str(tmp_path),
                         "--port", str(launcher.free_port())], capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "cannot serve --model-path" in proc.stderr and "config.json" in proc.stderr
