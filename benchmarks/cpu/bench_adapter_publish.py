"""Cost of one LoRA adapter publish to a real SGLang server, per transport: end to end, load call, bytes.

One real SGLang server (`third_party/launch_sglang.sh`, LoRA enabled with the job's launch flags,
`rollout/servers/lora_launch.py`) on an exported base at configs/qwen2_5.py's 0.5b shape (random weights) or
configs/tiny.py's model. Each transport (rollout.publish: disk = a PEFT directory and `/load_lora_adapter`;
tensor = shared-memory handles and `/load_lora_adapter_from_tensors`) publishes random rank-R adapters on every
linear layer the way the job does (WeightPublisher with an AdapterSync: load as policy-v{N}, confirm, route,
unload the idle old ones). Timed per publish: the whole publish (the learner's adapter to confirmed and routed)
and each admin call. The served log-probs of a probe must change between two versions (the adapter is applied).
Seconds per MB carry the figure to the 7B adapter's bytes (the issue's goal is by bytes).

  python -m benchmarks.cpu.bench_adapter_publish        # writes benchmarks/results/results-adapter-publish.{json,md}
  python -m benchmarks.cpu.bench_adapter_publish --shape=tiny --out=/tmp/adapter
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

from benchmarks.common import environment, records, summary
from benchmarks.cpu import publish_rounds as publish_rounds_lib, sglang_server
from benchmarks.cpu.bench_publish import REPO_ROOT, job_config

DEFAULT_OUT = {"0.5b": os.path.join(REPO_ROOT, "benchmarks", "results", "results-adapter-publish"),
               "tiny": os.path.join(REPO_ROOT, "benchmarks", "results", "quick", "results-adapter-publish")}
TRANSPORTS = ("disk", "tensor")
GOAL_S = {"0.5b": "<= 0.1"}  # the issue's: an adapter publish at the 0.5B shape, r = 16, CPU, end to end
GOAL_7B_S = 1.0               # and at 7B, by bytes
PROBE = [5, 6, 7, 8, 9, 10, 11, 12]
MB = 1e6


def adapter_bytes(size: str, rank: int, dtype_bytes: int) -> int:
  """The bytes of a rank-`rank` adapter on every linear layer of configs/qwen2_5.py's `size`."""
  from vcpo_jax.model import hf, lora
  cfg = hf.model_config(job_config(size).model)
  per_layer = sum(rank * (i + o) for i, o, _ in lora.module_dims(cfg).values())
  return per_layer * cfg.num_layers * dtype_bytes


def random_adapter(model_cfg, lora_cfg, version: int):
  """A rank-R adapter with nonzero B (a fresh one's B is zero: it would serve the base)."""
  import jax
  from vcpo_jax.model import lora
  ad = lora.init_adapter(jax.random.PRNGKey(version), model_cfg, lora_cfg)
  keys = iter(jax.random.split(jax.random.PRNGKey(10_000 + version), 1024))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: 0.01 * jax.random.normal(next(keys), x.shape, x.dtype) if "lora_B" in str(path[-1]) else x, ad)


async def _probe(client, url: str, name: str | None) -> list[float]:
  body = {"input_ids": PROBE, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
          "return_logprob": True, "logprob_start_len": 0}
  if name is not None:
    body["lora_path"] = name
  status, out = await client.request_json(url, "POST", "/generate", body)
  if status != 200:
    raise RuntimeError(f"/generate with lora_path={name} answered {status}: {out!r:.300}")
  return [float(e[0]) for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None]


async def publish_rounds(url: str, model_cfg, lora_cfg, root: str, transport: str, versions: list[int],
                         warmup: int, vocab: int) -> dict:
  """Publishes each version as the job does; the first `warmup` are not reported."""
  from vcpo_jax.model import peft_export
  from vcpo_jax.rollout import protocol
  from vcpo_jax.rollout.client import client as client_lib
  from vcpo_jax.rollout.servers import lora as lora_sync, publisher as publisher_lib
  calls: list[tuple[int, str, float]] = []
  adapters = {v: random_adapter(model_cfg, lora_cfg, v) for v in versions}
  peft = lambda ad: peft_export.to_peft(ad, model_cfg, lora_cfg, "float32")  # noqa: E731 (as HttpBackend._peft)
  sent = sum(a.nbytes for a in peft(adapters[versions[0]])[1].values())
  async with client_lib.RolloutClient([url], vocab_size=vocab) as client:
    sync = lora_sync.AdapterSync(client, peft, root, max_kept=3, timeout_s=120.0, transport=transport)
    current = [None]
    publish_rounds_lib._timed(sync.admin, calls, current)  # each admin call as (version, endpoint, seconds)
    pub = publisher_lib.WeightPublisher(lambda p, d: None, root, client, adapters=sync)
    rounds, probes = [], []
    try:
      for j, v in enumerate(versions):
        current[0] = v
        t0 = time.perf_counter()
        ok = await pub.publish(adapters[v], v)
        seconds = time.perf_counter() - t0
        if ok != {url: True}:
          raise RuntimeError(f"{transport}: version {v} was not confirmed: {ok}")
        if j >= warmup:
          rounds.append({"version": v, "publish_s": seconds,
                         "calls": [(p, s) for cv, p, s in calls if cv == v]})
        if j >= len(versions) - 2:  # the last two versions, each while it is the current one (idle olds unload)
          probes.append(await _probe(client, url, protocol.adapter_name(v)))
      probe = {"before": probes[0], "after": probes[1]}
    finally:
      await pub.close()
  return {"rounds": rounds, "bytes_sent": sent, "probe": probe}


def measure(args, workdir: str) -> dict:
  import dataclasses
  import jax
  from vcpo_jax.model import config as model_config, hf, hf_export, tokenizer as tokenizer_lib, transformer
  from vcpo_jax.rollout.servers import launcher, lora_launch
  config = job_config(args.shape)
  model_cfg = hf.model_config(config.model)
  lora_cfg = model_config.LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
  model_cfg = dataclasses.replace(model_cfg, lora=lora_cfg)
  tok = tokenizer_lib.for_model(config.model.get("hf_path", ""))
  base = hf_export.export(transformer.init_params(model_cfg, jax.random.PRNGKey(0)), model_cfg,
                          os.path.join(workdir, "base"), tok, args.server_dtype)
  serving = lora_launch.LoraServing(args.rank, lora_launch.ALL_TARGETS, max_lag=1)
  port = launcher.free_port()
  url, log_path = f"http://127.0.0.1:{port}", os.path.join(workdir, "sglang.log")
  proc = sglang_server.start(base, port, log_path, python=args.sglang_python, device="cpu",
                             dtype=args.server_dtype, flags=lora_launch.server_flags(serving))
  out, first = {}, 1
  try:
    ready_s = sglang_server.wait_ready(proc, url, log_path, args.server_timeout)
    for transport in args.transports:
      versions = list(range(first, first + args.warmup + args.repeats))
      out[transport] = asyncio.run(publish_rounds(url, model_cfg, lora_cfg, os.path.join(workdir, transport),
                                                  transport, versions, args.warmup, model_cfg.vocab_size))
      first = versions[-1] + 1
  finally:
    launcher.end_process_tree(proc, grace_s=10.0)
  return {"transports": out, "server_ready_s": ready_s, "rank": args.rank, "shape": args.shape,
          "server_dtype": args.server_dtype}


def figures(m: dict) -> list[dict]:
  out = []
  mb_7b = adapter_bytes("7b", 16, 4) / MB  # the 7B adapter (r = 16), float32 as the job sends it
  for name, t in m["transports"].items():
    seconds = [r["publish_s"] for r in t["rounds"]]
    mb = t["bytes_sent"] / MB
    note = (f"{name}: rank {m['rank']} on all seven linear layers, {mb:.3g} MB sent (float32), SGLang on cpu "
            f"serving {m['server_dtype']}" + ("; from the tiny shape fixed costs dominate: the 7B figure is no "
                                              "estimate" if m["shape"] == "tiny" else ""))
    out.append(records.figure(f"{name}_publish_s", f"{name}: whole adapter publish, end to end, s",
                              stats=summary.summarize(seconds), unit="s", goal=GOAL_S.get(m["shape"]), note=note))
    out.append(records.figure(f"{name}_publish_s_per_mb", f"{name}: whole adapter publish, s per MB sent",
                              stats=summary.summarize([s / mb for s in seconds]), unit="s/MB", note=note))
    per_mb = sorted(s / mb for s in seconds)[len(seconds) // 2]
    out.append(records.figure(f"{name}_publish_7b_s", f"{name}: estimated for 7B's r = 16 adapter by bytes "
                                                      f"({mb_7b:.0f} MB), s",
                              value=per_mb * mb_7b, unit="s", goal=f"<= {GOAL_7B_S}", note=note))
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="0.5b", choices=tuple(DEFAULT_OUT))
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--transports", default=",".join(TRANSPORTS), help=f"comma-separated, of {TRANSPORTS}")
  parser.add_argument("--server-dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--sglang-python", default=sglang_server.default_python())
  parser.add_argument("--server-timeout", type=float, default=900.0)
  parser.add_argument("--out", default=None)
  parser.add_argument("--note", default="")
  args = parser.parse_args(argv)
  args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
  if not args.transports or any(t not in TRANSPORTS for t in args.transports):
    parser.error(f"--transports must name some of {TRANSPORTS}, got {args.transports}")
  if args.repeats < 1 or args.warmup < 1 or args.rank < 1:
    parser.error(f"--repeats, --warmup and --rank must be >= 1, got {args.repeats}, {args.warmup}, {args.rank}")
  if not os.path.exists(args.sglang_python):
    parser.error(f"--sglang-python={args.sglang_python!r} does not exist (third_party/install_sglang_cpu.sh)")
  command = "python -m benchmarks.cpu.bench_adapter_publish " + " ".join(sys.argv[1:] if argv is None else argv)
  env = environment.environment()
  env["versions"]["sglang"] = sglang_server.version(args.sglang_python)
  with tempfile.TemporaryDirectory(prefix="bench_adapter-") as tmp:
    m = measure(args, tmp)
  for name, t in m["transports"].items():
    moved = max(abs(a - b) for a, b in zip(t["probe"]["after"], t["probe"]["before"]))
    if not moved > 0:
      raise RuntimeError(f"{name}: the served log-probs did not change between two adapters")
    t["probe"]["moved"] = moved
  results = {"command": command, "environment": env, "figures": figures(m), **m}
  if args.note:
    results["note"] = args.note
  lines = ["## Publishes", "", f"Server (LoRA enabled) ready in {m['server_ready_s']:.1f} s.", "",
           "| transport | version | publish s | admin calls, s |", "| --- | --- | --- | --- |"]
  for name, t in m["transports"].items():
    for r in t["rounds"]:
      calls = ", ".join(f"{p} {s:.3f}" for p, s in r["calls"])
      lines.append(f"| {name} | v{r['version']} | {r['publish_s']:.3f} | {calls} |")
  lines.append("")
  for name, t in m["transports"].items():
    lines.append(f"Served log-probs ({name}): a {len(PROBE)}-token probe moved by up to {t['probe']['moved']:.3g} "
                 "between the last two adapters.")
  records.write_results(results, args.out or DEFAULT_OUT[args.shape], "Cost of a LoRA adapter publish, per transport",
                        ["\n".join(lines)])
  return results


if __name__ == "__main__":
  main()
