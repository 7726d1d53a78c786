"""The SGLang-protocol rollout backend: servers (embedded, or rollout.server_urls), client, scheduler, publisher."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import re
from typing import Any, Optional

import jax
import ml_collections

from vcpo_jax.model import hf_export, peft_export
from vcpo_jax.parallel import placement
from vcpo_jax.rollout import backend, dynamic_sampling, episodes as episodes_lib, protocol, types
from vcpo_jax.rollout.client import client as client_lib, scheduler as scheduler_lib
from vcpo_jax.rollout.servers import admin as admin_lib, background, launcher, publisher as publisher_lib
from vcpo_jax.rollout.servers import lora as lora_sync, lora_launch, weight_store
from vcpo_jax.rollout.servers import tensor as tensor_lib, wire as wire_lib, wire_group


def flat_metrics(stats: dict, prefix: str = "rollout/") -> dict[str, float]:
  """Numeric stats as flat TensorBoard names (server URLs become legal name parts); one level of nesting."""
  out = {}
  for key, value in stats.items():
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      out[f"{prefix}{key}"] = float(value)
    elif isinstance(value, dict):
      for sub, v in value.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
          out[f"{prefix}{key}/{re.sub(r'[^A-Za-z0-9_.-]+', '_', str(sub))}"] = float(v)
  return out


def starting_weights_dir(workdir: str, hf_path: str = "") -> Optional[str]:
  """The job's starting weights as servers are launched on them: WORKDIR/base (export_base), else hf_path."""
  for path in (os.path.join(workdir, "base"), hf_path):
    if path and os.path.isfile(os.path.join(path, "config.json")):
      return path
  return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class HttpBackendConfig(backend.SamplingFields):
  """The config fields the http backend reads, named as in the config (backend.read_config builds it)."""
  hf_path: str = backend.config_field("model", "")  # external servers' starting weights, when no WORKDIR/base
  server_urls: str = backend.config_field("rollout")
  num_servers: int = backend.config_field("rollout")
  base_port: int = backend.config_field("rollout")
  request_timeout: float = backend.config_field("rollout")
  max_retries: int = backend.config_field("rollout")
  keep_versions: int = backend.config_field("rollout")
  publish_dtype: str = backend.config_field("rollout", "auto")
  publish_dir: str = backend.config_field("rollout", "")
  server_devices: str = backend.config_field("rollout", "")
  learner_memory_fraction: float = backend.config_field("rollout", 0.0)
  server_memory_fraction: float = backend.config_field("rollout", 0.0)
  # How versions after the first reach the servers: "disk" (export + update_weights_from_disk), "wire"
  # (a torch group, buckets broadcast from the learner; rollout/servers/wire.py) or "tensor" (same host:
  # handles to shared memory / CUDA IPC, update_weights_from_tensor; rollout/servers/tensor.py).
  publish: str = backend.config_field("rollout", "disk")
  wire_bucket_mb: float = backend.config_field("rollout", 512.0)
  wire_backend: str = backend.config_field("rollout", "auto")
  wire_timeout_s: float = backend.config_field("rollout", 60.0)
  wire_master_address: str = backend.config_field("rollout", "")
  server_cpus: str = backend.config_field("rollout", "")
  # External servers (a fleet's, started alongside the learner): RL starts once this many answer (0: all).
  min_servers: int = backend.config_field("rollout", 0)
  server_wait_s: float = backend.config_field("rollout", 600.0)


class HttpBackend(backend.RolloutBackend):
  """Servers generate with version v while the learner computes v+1; the scheduler keeps lag <= k.

  Embedded servers start from the exported starting weights; external servers (server_urls) get them
  published. Each group is scored in the scheduler's completion hook, as soon as its samples arrive.
  A publish runs in the background (one process): publish() waits for the previous one, dispatches the
  HF-layout copy of the params in the served dtype on their devices, and returns; the scheduler admits new
  groups at the version the servers serve until the publish has landed, so rows keep truthful version tags.
  With model.lora the servers keep the starting weights (WORKDIR/base) and every version, 0 included, is the
  adapter alone, loaded as `policy-v{N}` (rollout/servers/lora.py; rollout.publish disk or tensor).
  """

  def __init__(self, ctx: backend.RolloutContext, cfg: HttpBackendConfig):
    self.ctx, self.cfg = ctx, cfg
    # Multi-turn tasks: each sample is an episode of /generate turns.
    self.episodes = episodes_lib.runner_for(ctx.task, ctx.tokenizer, max_new_tokens=cfg.max_new_tokens,
                                            context_length=ctx.model_cfg.max_seq_len)
    self.sampling_params = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                            "stop_token_ids": list(ctx.tokenizer.stop_ids), "no_stop_trim": True,
                            "sampling_seed": cfg.seed}
    self.group_size, self.batch_groups, self.max_lag = cfg.group_size, cfg.prompts_per_step, cfg.max_lag
    self.urls = [u.strip() for u in cfg.server_urls.split(",") if u.strip()]
    self._servers: list = []  # embedded servers this backend started (and stops)
    self._client: Optional[client_lib.RolloutClient] = None
    self._publisher: Optional[publisher_lib.WeightPublisher] = None
    self._sched: Optional[scheduler_lib.RolloutScheduler] = None
    self._restored: Optional[dict] = None
    self._pending = background.BackgroundPublish()
    self._spare: Optional[hf_export.HfLayout] = None  # a published layout; the next one is written into it
    self._background = jax.process_count() == 1  # followers join a publish's gathers only inside publish()
    # External servers were launched on the job's starting weights; exports and served models are checked
    # against them (embedded servers: against the directory they are started on).
    self.reference_dir = starting_weights_dir(ctx.workdir, cfg.hf_path)
    self.export_dtype = weight_store.publish_dtype(cfg.publish_dtype, self.reference_dir, ctx.model_cfg.param_dtype)
    # Empty publish_dir: RAM-backed when the job starts its servers (WORKDIR/weights links to it). Not for
    # rollout.server_urls, even on loopback: those servers were launched by someone else, and an embedded one
    # among them reads only below the weights root it was given.
    self.weights_root = weight_store.publish_root(
        cfg.publish_dir, ctx.workdir, servers_are_local=not self.urls,
        version_bytes=hf_export.export_bytes(ctx.model_cfg, self.export_dtype), keep_last=cfg.keep_versions)
    if cfg.publish not in ("disk", "wire", "tensor"):
      raise ValueError(f"invalid config: rollout.publish={cfg.publish!r}: must be 'disk', 'wire' or 'tensor'")
    if cfg.publish == "tensor" and not weight_store.servers_local(self.urls):
      raise ValueError(f"invalid config: rollout.publish='tensor': the servers must run on this host (handles "
                       f"to shared memory), got rollout.server_urls={cfg.server_urls!r}")
    lora = ctx.model_cfg.lora
    self.lora = lora_launch.LoraServing(lora.rank, lora.target_modules, cfg.max_lag) if lora.rank else None
    if self.lora is not None and cfg.publish == "wire":
      raise ValueError(f"invalid config: rollout.publish='wire' with model.lora.rank={lora.rank}: adapters are "
                       "published by 'disk' or 'tensor'")
    if self.lora is not None and self.reference_dir is None:
      raise ValueError(f"invalid config: model.lora.rank={lora.rank} needs the base the servers serve: "
                       f"WORKDIR/base or model.hf_path (got {cfg.hf_path!r})")
    if cfg.publish != "disk":
      try:
        (wire_group if cfg.publish == "wire" else tensor_lib).require_torch()
      except ImportError as e:
        raise ValueError(f"invalid config: rollout.publish={cfg.publish!r}: {e}") from e

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, ctx: backend.RolloutContext) -> "HttpBackend":
    return cls(ctx, backend.read_config(HttpBackendConfig, config))

  def _layout(self, params: Any) -> hf_export.HfLayout:
    spare, self._spare = self._spare, None
    return hf_export.hf_layout(params, self.ctx.model_cfg, self.export_dtype, recycle=spare)

  def _export(self, layout: hf_export.HfLayout, out_dir: str) -> None:
    hf_export.write_hf(layout, out_dir, self.ctx.tokenizer)

  async def _start_embedded(self, version: int, params: Any) -> list[str]:
    """Embedded servers start directly from the current version's directory (with LoRA: from the base, with
    LoRA's flags; the adapter is published next)."""
    wire = protocol.version_to_wire(version)
    if self.lora is None:
      first_dir = os.path.join(self.weights_root, wire)
      await asyncio.to_thread(self._export, self._layout(params), first_dir)
      self.reference_dir = first_dir
    else:
      first_dir = self.reference_dir
    workdir = self.ctx.workdir
    self._servers = await asyncio.to_thread(
        launcher.start_servers, self.cfg.num_servers, first_dir, weights_root=self.weights_root,
        base_port=self.cfg.base_port, log_dir=os.path.join(workdir, "logs"),
        weight_version=wire, envs=placement.rollout_plan(self.cfg, self.cfg.num_servers).server_envs,
        cpus=placement.parse_cpus(self.cfg.server_cpus),
        extra_args=("--max-batch", str(max(64, self.ctx.batch_rows)),
                    # A cache named in the environment is shared (the test suite's jobs share one per run).
                    "--compilation-cache-dir",
                    os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(workdir, "jax_cache"),
                    *lora_launch.server_flags(self.lora)))
    return [s.url for s in self._servers]

  async def start(self, version: int, params: Any) -> None:
    os.makedirs(self.weights_root, exist_ok=True)
    urls = self.urls or await self._start_embedded(version, params)
    # Servers take their context length from the exported config (max_position_embeddings = max_seq_len).
    self._client = client_lib.RolloutClient(urls, vocab_size=self.ctx.model_cfg.vocab_size,
                                            context_length=self.ctx.model_cfg.max_seq_len,
                                            request_timeout=self.cfg.request_timeout,
                                            max_retries=self.cfg.max_retries)
    await self._client.start()
    if self.urls:  # a fleet's servers may still be loading (or never come): wait, with a deadline
      await self._client.wait_for_servers(self.cfg.min_servers or len(self.urls), self.cfg.server_wait_s,
                                          f"rollout.min_servers={self.cfg.min_servers} "
                                          f"(rollout.server_wait_s={self.cfg.server_wait_s:g})")
    if self.lora is not None:
      await self._start_adapters(version, params)
    else:
      await self._start_weights(version, params, urls)
    if self.sampling_params["temperature"] != 1.0:  # SGLang's log-probs are scaled unless told otherwise
      await self._client.check_raw_logprobs(self.sampling_params["temperature"], list(range(1, 9)))
    generate = self._client.generate
    if self.episodes is not None:  # one episode per sample, each turn a /generate through the same client
      generate = functools.partial(self.episodes.generate, self._client.generate)
    self._sched = scheduler_lib.RolloutScheduler(
        generate, self.ctx.prompts, sampling_params=self.sampling_params,
        group_size=self.group_size, batch_groups=self.batch_groups, max_lag=self.max_lag,
        on_complete=self.ctx.rewarder.score_group, pass_example=self.episodes is not None,
        group_filter=dynamic_sampling.GroupFilter.from_section(self.cfg.dynamic_sampling,
                                                               batch_groups=self.batch_groups))
    if self._restored is not None:
      self._sched.load_state_dict(self._restored)
    self._sched.set_served_version(version)

  async def _start_weights(self, version: int, params: Any, urls: list[str]) -> None:
    self._publisher = publisher_lib.WeightPublisher(self._export, self.weights_root, self._client,
                                                    keep_last=self.cfg.keep_versions,
                                                    reference_dir=self.reference_dir, wire=self._wire_sender(urls))
    if self.urls:  # external servers: check what they serve, then load the starting weights explicitly
      await self._publisher.check_servers()
      await self._publisher.publish(self._layout(params), version)
    else:  # embedded servers were started on this version's export
      self._publisher.adopt(version, self.reference_dir)

  async def _start_adapters(self, version: int, adapter: Any) -> None:
    """LoRA: servers given by URL are checked (launched with LoRA that fits, serving the base), then every
    server gets this version's adapter (version 0: B = 0, the base's function) like any later one."""
    sync = lora_sync.AdapterSync(self._client, self._peft, os.path.join(self.weights_root, "adapters"),
                                 max_kept=self.lora.max_kept, timeout_s=self.cfg.request_timeout,
                                 transport=self.cfg.publish)
    self._publisher = publisher_lib.WeightPublisher(self._export, self.weights_root, self._client,
                                                    keep_last=self.cfg.keep_versions,
                                                    reference_dir=self.reference_dir, adapters=sync)
    if self.urls:
      admin = admin_lib.AdminSession(self.cfg.request_timeout, lambda key, n=1: None)
      try:
        await lora_launch.check_servers(admin, self.urls, self.lora)
      finally:
        await admin.close()
      await self._publisher.check_servers()
    await self._publisher.publish(self._host_adapter(adapter), version)

  @staticmethod
  def _host_adapter(adapter: Any) -> Any:
    """A host copy of the adapter (gathered with the other processes inside multihost's leader_gathers)."""
    return peft_export.host_copy(adapter)

  def _peft(self, adapter: Any) -> tuple[dict, dict]:
    """The learner's adapter as PEFT's config and tensors (float32: exact, and small)."""
    return peft_export.to_peft(adapter, self.ctx.model_cfg, None, "float32")

  def _wire_sender(self, urls: list[str]):
    """The session transport for versions after the first (None: by disk)."""
    dtype = self.export_dtype  # the disk export's: a resync from disk serves the same bytes
    if self.cfg.publish == "tensor":
      return tensor_lib.TensorSender(self.ctx.model_cfg, dtype, bucket_mb=self.cfg.wire_bucket_mb,
                                     timeout_s=self.cfg.wire_timeout_s)
    if self.cfg.publish != "wire":
      return None
    address = self.cfg.wire_master_address or wire_lib.master_address(urls)
    return wire_lib.WireSender(self.ctx.model_cfg, dtype, bucket_mb=self.cfg.wire_bucket_mb,
                               backend=self.cfg.wire_backend, timeout_s=self.cfg.wire_timeout_s,
                               master_address=address)

  async def next_groups(self, version: int) -> list[types.Group]:
    return await self._sched.next_batch(version)

  async def publish(self, version: int, params: Any) -> None:
    await self._pending.wait()  # versions go out in order; a refused one raises here
    # Dispatched into fresh buffers (the next learner step may donate the params); an adapter is small: a host copy.
    layout = self._host_adapter(params) if self.lora is not None else self._layout(params)
    self._pending.start(functools.partial(self._publish, layout, version))
    if not self._background:
      await self._pending.wait()

  async def _publish(self, layout: hf_export.HfLayout, version: int) -> None:
    await self._publisher.publish(layout, version)
    self._sched.set_served_version(version)  # new groups may now start at this version
    # read by no one now (a failed or cancelled publish's may be: never kept)
    if isinstance(layout, hf_export.HfLayout) and hf_export.worth_recycling(layout):
      self._spare = layout

  async def wait_published(self) -> None:
    await self._pending.wait()

  def last_publish_seconds(self) -> Optional[float]:
    return self._pending.last_seconds if self._background else None

  def stats(self) -> dict[str, float]:
    out = flat_metrics(self._client.stats) if self._client is not None else {}
    if self._sched is not None:
      out.update({**flat_metrics(self._sched.stats), **self._sched.filter_metrics()})
    return out

  def state_dict(self) -> dict:
    return {"scheduler": self._sched.state_dict()} if self._sched is not None else {}

  def load_state_dict(self, state: dict) -> None:
    self._restored = state.get("scheduler")

  async def close(self) -> None:
    try:
      await self._pending.cancel()  # after a normal end nothing is pending (rl_loop waited for it)
      if self._sched is not None:
        await self._sched.close()
      if self._publisher is not None:
        await self._publisher.close()
      if self._client is not None:
        await self._client.close()
    finally:
      launcher.stop_servers(self._servers)
      self._servers = []
