"""Asyncio rollout client: per-sample generation with retries, abort-resume within the context limits."""
from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any, Iterable, Optional

import aiohttp
import numpy as np

from vcpo_jax.rollout import generate_reply
from vcpo_jax.rollout import protocol
from vcpo_jax.rollout.client.pool import RolloutError, ServerPool
# Defined in generate_reply (the /generate exchange); importable from here as before.
from vcpo_jax.rollout.generate_reply import BadResponseError, Segment
from vcpo_jax.rollout.types import Sample


class ServerRequestError(RuntimeError):
  """A 4xx answer: the request itself is wrong, so it is not retried."""

  def __init__(self, url: str, status: int, message: str):
    super().__init__(f"{url} answered {status}: {message}")
    self.status = status


class _ServerError(RuntimeError):
  """A 5xx answer: retried on another server."""


def _error_message(text: str) -> str:
  try:
    return protocol.error_message(json.loads(text))
  except ValueError:
    return text[:500]


def stale_connection(e: BaseException) -> bool:
  """A pooled keep-alive connection the server closed while idle: the write or read fails at once.

  Connection refused (ClientConnectorError, also a ClientOSError) means the server is down instead.
  """
  return isinstance(e, (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)) and \
      not isinstance(e, aiohttp.ClientConnectorError)


class RolloutClient(ServerPool):
  """A pool of SGLang servers behind least-outstanding-requests routing, with liveness checks and retries.

  Use as `async with RolloutClient(urls, vocab_size=V) as client: samples = await client.generate(...)`.
  `context_length` (the servers' context length, default: no limit known) caps every request, first or
  resumed, to what SGLang accepts; a sample that cannot continue within it finishes as "length".
  `sample_log` (default: $VCPO_ROLLOUT_SAMPLE_LOG) appends every completed sample as a JSON line (ids,
  log-probs, versions): an audit trail to recompute against the exported weights of each version.
  """

  def __init__(self, urls: Iterable[str], *, vocab_size: int, max_prompt_len: Optional[int] = None,
               context_length: Optional[int] = None, max_retries: int = 4, max_resumes: int = 64,
               sample_log: Optional[str] = None, **pool_kwargs):
    super().__init__(urls, **pool_kwargs)
    for name, value in (("vocab_size", vocab_size), ("max_retries", max_retries + 1),
                        ("max_prompt_len", 1 if max_prompt_len is None else max_prompt_len),
                        ("context_length", 8 if context_length is None else context_length - 7)):
      if not protocol.is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int{' > 7' if name == 'context_length' else ''}, "
                         f"got {value!r}")
    self.vocab_size, self.max_prompt_len, self.context_length = vocab_size, max_prompt_len, context_length
    self.max_retries, self.max_resumes = max_retries, max_resumes
    self.sample_log = sample_log or os.environ.get("VCPO_ROLLOUT_SAMPLE_LOG") or None

  # -- generation --------------------------------------------------------------------------------
  def _check_prompt(self, prompt_ids: Any) -> list[int]:
    arr = np.asarray(prompt_ids)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
      raise ValueError(f"prompt_ids must be a non-empty 1-D sequence of ints, got {prompt_ids!r:.200}")
    ids = [int(t) for t in arr]
    bad = [t for t in ids if not 0 <= t < self.vocab_size]
    if bad:
      raise ValueError(f"prompt_ids {bad[:5]} outside [0, vocab_size={self.vocab_size})")
    if self.max_prompt_len is not None and len(ids) > self.max_prompt_len:
      raise ValueError(f"prompt_ids has {len(ids)} tokens > max_prompt_len={self.max_prompt_len}")
    if self.context_length is not None and len(ids) > protocol.max_input_len(self.context_length):
      raise ValueError(f"prompt_ids has {len(ids)} tokens; context_length={self.context_length} admits at "
                       f"most {protocol.max_input_len(self.context_length)} input tokens")
    return ids

  async def generate(self, prompt_ids: Any, sampling_params: dict, n: int = 1) -> list[Sample]:
    """n independent samples for one prompt. Sample i uses sampling_seed + i when a seed is given."""
    ids = self._check_prompt(prompt_ids)
    if not protocol.is_int(n) or n < 1:
      raise ValueError(f"n must be a positive int, got {n!r}")
    if not isinstance(sampling_params, dict):
      raise ValueError(f"sampling_params must be a dict, got {sampling_params!r}")
    if "n" in sampling_params:
      raise ValueError("sampling_params['n'] is not allowed: pass n= to generate()")
    if not protocol.is_int(sampling_params.get("max_new_tokens")):
      raise ValueError(f"sampling_params['max_new_tokens'] is required, got {sampling_params!r}")
    # The same checks a real server makes, before anything is sent (protocol.RequestError is a ValueError).
    protocol.parse_sampling_params(sampling_params, vocab_size=self.vocab_size)
    await self.start()
    seed = sampling_params.get("sampling_seed")
    per_sample = [dict(sampling_params, sampling_seed=seed + i) if seed is not None else sampling_params
                  for i in range(n)]
    self._counts["samples_requested"] += n
    return list(await asyncio.gather(*(self._generate_one(ids, p) for p in per_sample)))

  async def _generate_one(self, prompt_ids: list[int], params: dict) -> Sample:
    max_new, min_new = params["max_new_tokens"], params.get("min_new_tokens")
    out_ids, out_lp, out_ver, resumes, url = [], [], [], 0, ""
    while True:
      input_len = len(prompt_ids) + len(out_ids)
      step_new = protocol.fit_max_new_tokens(input_len, max_new - len(out_ids), self.context_length)
      if step_new <= 0 and len(out_ids) < max_new:  # no room left in the context: done, as SGLang would
        self._counts["context_capped"] += 1
        finish = "length"
        break
      step_params = dict(params, max_new_tokens=step_new)
      if min_new is not None:
        step_params["min_new_tokens"] = min(step_new, max(0, min_new - len(out_ids)))
      seg, url = await self._request_segment(prompt_ids + out_ids, step_params)
      out_ids += seg.output_ids
      out_lp += seg.logprobs
      out_ver += seg.versions
      finish = seg.finish_type
      if finish != "abort":
        break
      self._counts["aborted_resumed"] += 1
      if len(out_ids) >= max_new:
        finish = "length"
        break
      resumes += 1
      if resumes > self.max_resumes:
        raise RolloutError(f"generation aborted {resumes} times (max_resumes={self.max_resumes})")
      if not seg.output_ids:  # a server that aborts at once is probably paused: don't spin
        await asyncio.sleep(self._backoff(min(resumes, 6)))
    self._counts["samples_completed"] += 1
    if self.sample_log:
      with open(self.sample_log, "a") as f:
        f.write(json.dumps({"prompt_ids": prompt_ids, "output_ids": out_ids, "logprobs": out_lp,
                            "versions": out_ver, "finish": finish, "resumes": resumes, "url": url}) + "\n")
    return Sample(prompt_ids=list(prompt_ids), output_ids=out_ids,
                  output_logprobs=np.asarray(out_lp, np.float32),
                  token_versions=np.asarray(out_ver, np.int64), finish_reason=finish,
                  server_url=url, num_resumes=resumes)

  async def _request_segment(self, input_ids: list[int], params: dict) -> tuple[Segment, str]:
    """One /generate call, retried on another server after transport errors, 5xx and bad responses."""
    tried, last = set(), None
    for attempt in range(self.max_retries + 1):
      server = await self._pick(tried)
      tried.add(server.url)
      try:
        try:
          seg = await self._post_generate(server, input_ids, params)
        except aiohttp.ClientError as e:
          if not stale_connection(e):
            raise
          self._counts["stale_connection_retries"] += 1  # not the server's fault: once more, same server
          seg = await self._post_generate(server, input_ids, params)
        server.failures_in_a_row = 0
        return seg, server.url
      except BadResponseError as e:
        self._bad[e.kind] += 1
        last = e
      except asyncio.TimeoutError as e:  # before ClientError: aiohttp's timeouts subclass both
        self._counts["timeouts"] += 1
        last = e
      except (aiohttp.ClientError, ConnectionError) as e:
        self._counts["connection_errors"] += 1
        self._mark_healthy(server, False)
        last = e
      except _ServerError as e:
        self._counts["server_errors"] += 1
        last = e
      server.failures_in_a_row += 1
      if server.failures_in_a_row >= self.max_failures_in_a_row:
        self._mark_healthy(server, False)
      if attempt < self.max_retries:
        self._counts["retries"] += 1
        await asyncio.sleep(self._backoff(attempt))
    raise RolloutError(f"/generate failed {self.max_retries + 1} times; last error: {last!r}") from last

  async def _post_generate(self, server, input_ids: list[int], params: dict) -> Segment:
    rid = uuid.uuid4().hex
    adapter = self.adapter  # _pick chose a server that confirmed it; the request keeps it to the end
    payload = generate_reply.generate_payload(input_ids, params, rid, lora_path=adapter)
    dispatched_version = server.version
    server.outstanding += 1
    server.in_flight[adapter] += 1
    self._counts["requests"] += 1
    try:
      timeout = aiohttp.ClientTimeout(total=self.request_timeout)
      async with self._session.post(server.url + "/generate", json=payload, timeout=timeout) as resp:
        status, text = resp.status, await resp.text()
    except asyncio.TimeoutError:
      # The server keeps generating a request nobody waits for: ask it to stop (best effort).
      asyncio.get_running_loop().create_task(self._abort_quietly(server.url, rid))
      raise
    finally:
      server.outstanding -= 1
      server.in_flight[adapter] -= 1
    if status >= 500:
      raise _ServerError(f"{server.url} answered {status}: {_error_message(text)}")
    if status >= 400:
      raise ServerRequestError(server.url, status, _error_message(text))
    try:
      body = json.loads(text)
    except ValueError as e:
      raise BadResponseError("json", f"{e}: {text[:200]!r}") from None
    seg = generate_reply.parse_generate_response(body, vocab_size=self.vocab_size,
                                           max_new_tokens=params["max_new_tokens"],
                                           fallback_version=dispatched_version)
    if adapter is not None:  # the server's weight_version is the base's: the adapter's name is the version
      seg.versions = [protocol.adapter_version(adapter)] * len(seg.output_ids)
    return seg

  async def _abort_quietly(self, url: str, rid: str) -> None:
    try:
      await self.request_json(url, "POST", "/abort_request", {"rid": rid}, timeout=self.health_timeout)
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError):
      pass

  # -- capability check --------------------------------------------------------------------------
  async def check_raw_logprobs(self, temperature: float, probe_ids: list[int], atol: float = 1e-3) -> None:
    """Fails unless every server returns log-probs of the raw model (what the learner recomputes).

    At temperature T != 1 SGLang returns log_softmax(logits / T) unless started with
    SGLANG_RETURN_ORIGINAL_LOGPROB=1. Probe: sample one token t at T, then score prompt + [t] at T = 1
    (the prompt's own log-probs, which are raw); the two log-probs of t agree only on a raw server.
    """
    probe_ids = self._check_prompt(probe_ids)
    for url in self.urls:
      lp_sampled, tok = await self._probe_one(url, probe_ids, temperature)
      status, body = await self.request_json(url, "POST", "/generate", {
          "input_ids": probe_ids + [tok], "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
          # SGLang leaves the entry AT logprob_start_len empty: start one earlier, read the last entry.
          "return_logprob": True, "logprob_start_len": len(probe_ids) - 1})
      entries = (body.get("meta_info", {}) if isinstance(body, dict) else {}).get("input_token_logprobs")
      if status != 200 or not entries or entries[-1][1] != tok or entries[-1][0] is None:
        raise RolloutError(f"{url}: cannot score the log-prob probe (status {status}): {body!r:.300}")
      if abs(entries[-1][0] - lp_sampled) > atol:
        raise RolloutError(
            f"{url} returns temperature-scaled log-probs at temperature={temperature} ({lp_sampled:.4f} "
            f"vs raw {entries[-1][0]:.4f}): start SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB=1 "
            f"(third_party/launch_sglang.sh sets it)")
      self._counts["raw_logprob_checks"] += 1

  async def _probe_one(self, url: str, probe_ids: list[int], temperature: float) -> tuple[float, int]:
    status, body = await self.request_json(url, "POST", "/generate", generate_reply.generate_payload(
        probe_ids, {"max_new_tokens": 1, "temperature": temperature}, uuid.uuid4().hex))
    if status != 200:
      raise RolloutError(f"{url}: log-prob probe answered {status}: {body!r:.300}")
    seg = generate_reply.parse_generate_response(body, vocab_size=self.vocab_size, max_new_tokens=1)
    return seg.logprobs[0], seg.output_ids[0]
