"""Asyncio client for a pool of SGLang-protocol servers: routing, retries, abort-resume, strict validation."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import re
import uuid
from typing import Any, Iterable, Optional

import aiohttp
import numpy as np

from vcpo_jax.rollout import protocol
from vcpo_jax.rollout.types import Sample

_VERSION_RE = re.compile(r"v([0-9]+)")
_FINISH_TYPES = ("length", "stop", "abort")
# Servers compute log-softmax in float32; the sampled token's logprob can round to a hair above 0.
_LOGPROB_TOLERANCE = 1e-4


def version_to_wire(version: int) -> str:
  """Learner versions are ints; SGLang's weight_version is a string: 7 <-> "v7" (the one mapping)."""
  if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
    raise ValueError(f"weight_version must be a non-negative int, got {version!r}")
  return f"v{int(version)}"


def version_from_wire(text: Any) -> int:
  match = _VERSION_RE.fullmatch(text) if isinstance(text, str) else None
  if match is None:
    raise ValueError(f"weight_version must look like 'v<int>', got {text!r}")
  return int(match.group(1))


class RolloutError(RuntimeError):
  """A generation that could not be completed on any server."""


class ServerRequestError(RuntimeError):
  """A 4xx answer: the request itself is wrong, so it is not retried."""

  def __init__(self, url: str, status: int, message: str):
    super().__init__(f"{url} answered {status}: {message}")
    self.status = status


class BadResponseError(ValueError):
  """A response that breaks the protocol; `kind` names the broken field (used as a stats key)."""

  def __init__(self, kind: str, message: str):
    super().__init__(f"bad /generate response ({kind}): {message}")
    self.kind = kind


class _ServerError(RuntimeError):
  """A 5xx answer: retried on another server."""


@dataclasses.dataclass
class Segment:
  """The validated content of one /generate response."""
  output_ids: list[int]
  logprobs: list[float]
  versions: list[int]
  finish_type: str


def _error_message(text: str) -> str:
  try:
    return protocol.error_message(json.loads(text))
  except ValueError:
    return text[:500]


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _parse_versions(meta: dict, n: int, fallback: Optional[int]) -> list[int]:
  spans = meta.get("weight_versions")
  if spans is None:
    # Client-side tagging for servers without spans: the older of the reported and dispatched versions.
    candidates = [] if fallback is None else [fallback]
    if meta.get("weight_version") is not None:
      try:
        candidates.append(version_from_wire(meta["weight_version"]))
      except ValueError as e:
        raise BadResponseError("version", str(e)) from None
    if not candidates:
      raise BadResponseError("version", "meta_info has neither weight_versions nor weight_version")
    return [min(candidates)] * n
  if not isinstance(spans, list):
    raise BadResponseError("version", f"weight_versions must be a list, got {spans!r:.200}")
  versions, cursor = [], 0
  for span in spans:
    if not isinstance(span, dict) or not all(_is_int(span.get(k)) for k in ("start", "end")):
      raise BadResponseError("version", f"weight_versions span needs int start/end, got {span!r:.200}")
    if span["start"] != cursor or span["end"] < span["start"]:
      raise BadResponseError("version", f"weight_versions spans must tile [0, {n}), got {spans!r:.300}")
    try:
      version = version_from_wire(span.get("version"))
    except ValueError as e:
      raise BadResponseError("version", str(e)) from None
    versions.extend([version] * (span["end"] - span["start"]))
    cursor = span["end"]
  if cursor != n:
    raise BadResponseError("version", f"weight_versions cover {cursor} tokens, output has {n}")
  return versions


def parse_generate_response(body: Any, *, vocab_size: int, max_new_tokens: int,
                            fallback_version: Optional[int] = None) -> Segment:
  """Validates one single-prompt /generate response; raises BadResponseError naming the field."""
  if not isinstance(body, dict):
    raise BadResponseError("shape", f"expected a JSON object, got {type(body).__name__}")
  ids, meta = body.get("output_ids"), body.get("meta_info")
  if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
    raise BadResponseError("shape", f"output_ids must be a list of ints, got {ids!r:.200}")
  if not isinstance(meta, dict):
    raise BadResponseError("shape", f"meta_info must be an object, got {meta!r:.200}")
  n = len(ids)
  bad_ids = [t for t in ids if not 0 <= t < vocab_size]
  if bad_ids:
    raise BadResponseError("out_of_vocab", f"output_ids {bad_ids[:5]} outside [0, {vocab_size})")
  if n > max_new_tokens:
    raise BadResponseError("length", f"{n} output_ids but max_new_tokens was {max_new_tokens}")
  if meta.get("completion_tokens") != n:
    raise BadResponseError(
        "length", f"completion_tokens={meta.get('completion_tokens')!r} but len(output_ids)={n}")
  entries = meta.get("output_token_logprobs")
  if not isinstance(entries, list) or len(entries) != n:
    got = len(entries) if isinstance(entries, list) else repr(entries)[:100]
    raise BadResponseError("length", f"output_token_logprobs has {got} entries, output_ids has {n}")
  logprobs = []
  for i, entry in enumerate(entries):
    if not isinstance(entry, (list, tuple)) or len(entry) < 2:
      raise BadResponseError("logprob", f"output_token_logprobs[{i}]={entry!r:.100} is not [lp, id, ...]")
    lp, tok = entry[0], entry[1]
    if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
      raise BadResponseError("logprob", f"output_token_logprobs[{i}][0]={lp!r} is not a finite number")
    if lp > _LOGPROB_TOLERANCE:
      raise BadResponseError("logprob", f"output_token_logprobs[{i}][0]={lp!r} is > 0")
    if tok != ids[i]:
      raise BadResponseError("token_mismatch", f"output_token_logprobs[{i}][1]={tok!r} != output_ids[{i}]={ids[i]}")
    logprobs.append(min(float(lp), 0.0))
  finish = meta.get("finish_reason")
  if not isinstance(finish, dict) or finish.get("type") not in _FINISH_TYPES:
    raise BadResponseError("finish_reason", f"finish_reason must have type in {_FINISH_TYPES}, got {finish!r:.200}")
  versions = _parse_versions(meta, n, fallback_version)
  return Segment(ids, logprobs, versions, finish["type"])


@dataclasses.dataclass
class _Server:
  url: str
  healthy: bool = True  # health checks and transport errors
  enabled: bool = True  # publisher: weights in sync
  outstanding: int = 0
  picks: int = 0
  failures_in_a_row: int = 0
  version: Optional[int] = None  # last version the publisher installed

  @property
  def available(self) -> bool:
    return self.healthy and self.enabled


class RolloutClient:
  """A pool of SGLang servers behind least-outstanding-requests routing, with health checks and retries.

  Use as `async with RolloutClient(urls, vocab_size=V) as client: samples = await client.generate(...)`.
  """

  def __init__(self, urls: Iterable[str], *, vocab_size: int, max_prompt_len: Optional[int] = None,
               request_timeout: float = 600.0, max_retries: int = 4, backoff_base: float = 0.05,
               backoff_max: float = 2.0, health_interval: float = 2.0, health_timeout: float = 5.0,
               max_resumes: int = 64, server_wait_timeout: float = 120.0, max_failures_in_a_row: int = 3,
               max_connections: int = 1024):
    urls = [u.rstrip("/") for u in urls]
    if not urls or len(set(urls)) != len(urls):
      raise ValueError(f"urls must be a non-empty list of distinct server urls, got {urls!r}")
    for name, value in (("vocab_size", vocab_size), ("max_retries", max_retries + 1),
                        ("max_prompt_len", 1 if max_prompt_len is None else max_prompt_len)):
      if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("request_timeout", request_timeout), ("backoff_base", backoff_base),
                        ("health_interval", health_interval), ("health_timeout", health_timeout)):
      if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    self.vocab_size, self.max_prompt_len = vocab_size, max_prompt_len
    self.request_timeout, self.max_retries = request_timeout, max_retries
    self.backoff_base, self.backoff_max = backoff_base, backoff_max
    self.health_interval, self.health_timeout = health_interval, health_timeout
    self.max_resumes, self.server_wait_timeout = max_resumes, server_wait_timeout
    self.max_failures_in_a_row, self._max_connections = max_failures_in_a_row, max_connections
    self.required_version: Optional[int] = None  # set by the publisher; recovered servers must match it
    self._servers = {u: _Server(u) for u in urls}
    self._counts = collections.Counter()
    self._bad = collections.Counter()
    self._session: Optional[aiohttp.ClientSession] = None
    self._health_task: Optional[asyncio.Task] = None
    self._changed: Optional[asyncio.Event] = None  # created in start(), inside the running loop

  # -- lifecycle ---------------------------------------------------------------------------------
  async def start(self) -> None:
    if self._session is None:
      self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._max_connections))
      self._changed = asyncio.Event()
      self._health_task = asyncio.create_task(self._health_loop())

  async def close(self) -> None:
    if self._health_task is not None:
      self._health_task.cancel()
      await asyncio.gather(self._health_task, return_exceptions=True)
      self._health_task = None
    if self._session is not None:
      await self._session.close()
      self._session = None

  async def __aenter__(self) -> "RolloutClient":
    await self.start()
    return self

  async def __aexit__(self, *exc) -> None:
    await self.close()

  # -- pool state --------------------------------------------------------------------------------
  @property
  def urls(self) -> list[str]:
    return list(self._servers)

  @property
  def available_urls(self) -> list[str]:
    return [s.url for s in self._servers.values() if s.available]

  @property
  def stats(self) -> dict:
    out = dict(self._counts)
    out["bad_responses"] = dict(self._bad)
    out["outstanding"] = {u: s.outstanding for u, s in self._servers.items()}
    out["available"] = {u: s.available for u, s in self._servers.items()}
    return out

  def _server(self, url: str) -> _Server:
    try:
      return self._servers[url.rstrip("/")]
    except KeyError:
      raise ValueError(f"url {url!r} is not in this client's pool {self.urls}") from None

  def set_enabled(self, url: str, enabled: bool) -> None:
    """The publisher takes an out-of-sync server out of rotation and returns it once re-synced."""
    self._server(url).enabled = enabled
    self._notify()

  def is_enabled(self, url: str) -> bool:
    return self._server(url).enabled

  def set_server_version(self, url: str, version: int) -> None:
    self._server(url).version = version

  def _notify(self) -> None:
    if self._changed is not None:
      self._changed.set()

  def _mark_healthy(self, server: _Server, healthy: bool) -> None:
    if server.healthy != healthy:
      self._counts["marked_up" if healthy else "marked_down"] += 1
      server.healthy = healthy
      server.failures_in_a_row = 0
      self._notify()

  # -- health ------------------------------------------------------------------------------------
  async def request_json(self, url: str, method: str, path: str, payload: Any = None,
                         timeout: Optional[float] = None) -> tuple[int, Any]:
    """One HTTP call; returns (status, parsed JSON or raw text). Transport errors propagate."""
    await self.start()
    client_timeout = aiohttp.ClientTimeout(total=timeout or self.request_timeout)
    async with self._session.request(method, url.rstrip("/") + path, json=payload,
                                     timeout=client_timeout) as resp:
      text = await resp.text()
    try:
      return resp.status, json.loads(text) if text else None
    except ValueError:
      return resp.status, text

  async def check_health(self) -> None:
    """Probes every server once: dead ones leave the rotation, recovered ones come back."""
    await asyncio.gather(*(self._probe(s) for s in self._servers.values()))

  async def _probe(self, server: _Server) -> None:
    try:
      status, _ = await self.request_json(server.url, "GET", "/health", timeout=self.health_timeout)
      ok = status == 200
      if ok and not server.healthy and self.required_version is not None:
        # A restarted server comes back with its start-up weights: keep it out until re-synced.
        status, info = await self.request_json(server.url, "GET", "/get_model_info",
                                               timeout=self.health_timeout)
        wanted = version_to_wire(self.required_version)
        if not (status == 200 and isinstance(info, dict) and info.get("weight_version") == wanted):
          server.enabled = False
    except (aiohttp.ClientError, asyncio.TimeoutError):
      ok = False
    self._mark_healthy(server, ok)

  async def _health_loop(self) -> None:
    while True:
      await asyncio.sleep(self.health_interval)
      await self.check_health()

  # -- routing -----------------------------------------------------------------------------------
  async def _pick(self, avoid: set[str]) -> _Server:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + self.server_wait_timeout
    while True:
      candidates = [s for s in self._servers.values() if s.available]
      preferred = [s for s in candidates if s.url not in avoid] or candidates
      if preferred:
        server = min(preferred, key=lambda s: (s.outstanding, s.picks))
        server.picks += 1
        return server
      remaining = deadline - loop.time()
      if remaining <= 0:
        raise RolloutError(f"no rollout server available for {self.server_wait_timeout}s: {self.stats}")
      self._changed.clear()
      try:
        await asyncio.wait_for(self._changed.wait(), min(remaining, self.health_interval))
      except asyncio.TimeoutError:
        await self.check_health()

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
    return ids

  async def generate(self, prompt_ids: Any, sampling_params: dict, n: int = 1) -> list[Sample]:
    """n independent samples for one prompt. Sample i uses sampling_seed + i when a seed is given."""
    ids = self._check_prompt(prompt_ids)
    if not _is_int(n) or n < 1:
      raise ValueError(f"n must be a positive int, got {n!r}")
    if not isinstance(sampling_params, dict):
      raise ValueError(f"sampling_params must be a dict, got {sampling_params!r}")
    if "n" in sampling_params:
      raise ValueError("sampling_params['n'] is not allowed: pass n= to generate()")
    if not _is_int(sampling_params.get("max_new_tokens")):
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
    out_ids, out_lp, out_ver, resumes = [], [], [], 0
    while True:
      remaining = max_new - len(out_ids)
      step_params = dict(params, max_new_tokens=remaining)
      if min_new is not None:
        step_params["min_new_tokens"] = max(0, min_new - len(out_ids))
      seg, url = await self._request_segment(prompt_ids + out_ids, step_params)
      out_ids += seg.output_ids
      out_lp += seg.logprobs
      out_ver += seg.versions
      finish = seg.finish_type
      if finish == "abort":
        self._counts["aborted_resumed"] += 1
        if len(out_ids) >= max_new:
          finish = "length"
        else:
          resumes += 1
          if resumes > self.max_resumes:
            raise RolloutError(f"generation aborted {resumes} times (max_resumes={self.max_resumes})")
          if not seg.output_ids:  # a server that aborts at once is probably paused: don't spin
            await asyncio.sleep(self._backoff(min(resumes, 6)))
          continue
      self._counts["samples_completed"] += 1
      return Sample(prompt_ids=list(prompt_ids), output_ids=out_ids,
                    output_logprobs=np.asarray(out_lp, np.float32),
                    token_versions=np.asarray(out_ver, np.int64), finish_reason=finish,
                    server_url=url, num_resumes=resumes)

  def _backoff(self, attempt: int) -> float:
    return min(self.backoff_max, self.backoff_base * 2.0 ** attempt)

  async def _request_segment(self, input_ids: list[int], params: dict) -> tuple[Segment, str]:
    """One /generate call, retried on another server after transport errors, 5xx and bad responses."""
    tried, last = set(), None
    for attempt in range(self.max_retries + 1):
      server = await self._pick(tried)
      tried.add(server.url)
      try:
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

  async def _post_generate(self, server: _Server, input_ids: list[int], params: dict) -> Segment:
    rid = uuid.uuid4().hex
    payload = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "rid": rid}
    dispatched_version = server.version
    server.outstanding += 1
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
    if status >= 500:
      raise _ServerError(f"{server.url} answered {status}: {_error_message(text)}")
    if status >= 400:
      raise ServerRequestError(server.url, status, _error_message(text))
    try:
      body = json.loads(text)
    except ValueError as e:
      raise BadResponseError("json", f"{e}: {text[:200]!r}") from None
    return parse_generate_response(body, vocab_size=self.vocab_size,
                                   max_new_tokens=params["max_new_tokens"],
                                   fallback_version=dispatched_version)

  async def _abort_quietly(self, url: str, rid: str) -> None:
    try:
      await self.request_json(url, "POST", "/abort_request", {"rid": rid}, timeout=self.health_timeout)
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError):
      pass
