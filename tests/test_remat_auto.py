"""model.remat='auto': the chosen policy's compiled step (XLA memory analysis, abstract inputs, 8 fake devices)
fits the documented device of each shipped Qwen2.5 config, at its own rows and at 8k-token rows."""
import dataclasses
import logging
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import skip_if_not_enough_devices
from flax import linen as nn

from configs import qwen2_5
from vcpo_jax.job import configuration
from vcpo_jax.learner import batch as batch_lib
from vcpo_jax.learner import step as learner, train_state
from vcpo_jax.model import config as model_config
from vcpo_jax.model import hf, remat
from vcpo_jax.parallel import sharding


def _compile(cfg, lc, opt, mesh, rows: int, seq_len: int):
  """The job's sharded RL step, lowered and compiled on abstract inputs: (XLA's GB per device, the remat
  policy the step ran, remat.py's estimate for it in GB)."""
  state = jax.eval_shape(lambda k: train_state.create_train_state(cfg, opt, k), jax.random.PRNGKey(0))
  s = jax.ShapeDtypeStruct
  batch = batch_lib.RLBatch(tokens_BxT=s((rows, seq_len), jnp.int32), mask_BxT=s((rows, seq_len), jnp.float32),
                            sampler_logp_BxT=s((rows, seq_len), jnp.float32), rewards_B=s((rows,), jnp.float32),
                            group_B=s((rows,), jnp.int32), lag_B=s((rows,), jnp.int32),
                            valid_B=s((rows,), jnp.float32))
  state_sh = train_state.state_shardings(cfg, opt, mesh, sharding.DEFAULT_RULES)
  chosen = []

  def fn(state, batch):
    with jax.default_matmul_precision(cfg.matmul_precision):
      shards = train_state.batch_rows(mesh)
      rows_dev = -(-(lc.micro_batch_size or rows) // shards)
      state_b = remat.state_bytes_per_device(state, grad_copies=2 if lc.micro_batch_size else 1)
      policy = remat.resolve(cfg, rows_dev, seq_len, state_b).remat
      chosen.append((policy, remat.estimate_gb(cfg, policy, rows_dev, seq_len, state_b)))
      return learner.rl_step(state, batch, model_cfg=cfg, learner_cfg=lc, optimizer=opt, row_shards=shards)

  jitted = jax.jit(fn, in_shardings=(state_sh, sharding.batch_sharding(mesh, ndim=1)),
                   out_shardings=(state_sh, sharding.replicated(mesh)), donate_argnums=0)
  with jax.set_mesh(mesh), nn.logical_axis_rules(list(sharding.DEFAULT_RULES)):
    mem = jitted.lower(state, batch).compile().memory_analysis()
  per_device = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                - mem.alias_size_in_bytes)
  return (per_device / 1e9,) + chosen[0]


def _case(size: str, seq_len: int | None):
  """(model config, learner config, optimizer, mesh, rows) of configs/qwen2_5.py:<size> on its documented
  device at its own rows (seq_len None) or at `seq_len`-token rows on qwen2_5.LONG_ROWS_DEVICES; the step is
  one micro-batch of rows (one group), which is what its memory depends on."""
  job = qwen2_5.get_config(size)
  devices, gb = qwen2_5.DEVICES[size] if seq_len is None else qwen2_5.LONG_ROWS_DEVICES
  cfg = hf.model_config(job.model)
  cfg = dataclasses.replace(cfg, max_seq_len=seq_len or cfg.max_seq_len, remat_budget_gb=gb)
  lc = dataclasses.replace(configuration.learner_config(job), micro_batch_size=0)
  mesh = sharding.make_mesh(dict(data=1, fsdp=devices, tensor=1), devices=jax.devices()[:devices])
  return cfg, lc, configuration.build_optimizer(job), mesh, job.algo.micro_batch_size


# (size, tokens per row): the config's own rows (prompt + rl.max_new_tokens) or the paper's long-response regime
# (8 rows of 8,192 tokens, one group per micro-batch). Every pair is documented; the suite compiles one per size,
# both regimes and both device counts among them (`python tests/test_remat_auto.py` prints all six, every policy).
ALL_CASES = [(size, t) for size in ("0.5b", "1.5b", "7b") for t in (None, 8192)]
CASES = [("0.5b", 8192), ("1.5b", None), ("7b", None)]


@pytest.mark.slow
@pytest.mark.parametrize("size,seq_len", CASES)
def test_shipped_config_fits_its_device(size, seq_len, caplog):
  cfg, lc, opt, mesh, rows = _case(size, seq_len)
  assert cfg.remat == "auto", f"configs/qwen2_5.py:{size} should let the budget pick remat"
  with caplog.at_level(logging.INFO):
    per_device_gb, chosen, est_gb = _compile(cfg, lc, opt, mesh, rows, cfg.max_seq_len)
  budget = cfg.remat_budget_gb
  print(f"{size} T={cfg.max_seq_len} rows={rows} over {mesh.devices.size} devices: remat={chosen}, "
        f"XLA {per_device_gb:.2f} GB per device, estimate {est_gb:.2f} GB (budget {budget})")
  assert per_device_gb <= budget, (size, seq_len, chosen, per_device_gb)
  assert any("model.remat=auto" in r.getMessage() for r in caplog.records)


def test_auto_picks_the_least_recompute_that_fits_and_full_when_nothing_does():
  """The rule on a small model: a huge budget keeps everything (none), a budget between the estimates of two
  policies picks the cheaper-in-memory one exactly there, and a tiny budget falls back to full."""
  cfg = model_config.ModelConfig(remat="auto", remat_budget_gb=1e6, max_seq_len=64)
  est = {p: remat.estimate_gb(cfg, p, 4, 64, 0.0) for p in remat.ORDER}
  assert est["none"] > est["dots"] >= est["dots_no_batch"] > est["full"] > 0, est
  assert remat.choose(cfg, 4, 64, 0.0)[0] == "none"
  between = dataclasses.replace(cfg, remat_budget_gb=(est["dots_no_batch"] + est["full"]) / 2)
  assert remat.choose(between, 4, 64, 0.0)[0] == "full"
  between = dataclasses.replace(cfg, remat_budget_gb=(est["none"] + est["dots"]) / 2)
  assert remat.choose(between, 4, 64, 0.0)[0] == "dots"
  policy, reason = remat.choose(dataclasses.replace(cfg, remat_budget_gb=1e-9), 4, 64, 0.0)
  assert policy == "full" and reason.startswith("no policy fits")
  assert remat.resolve(dataclasses.replace(cfg, remat="dots"), 4, 64, 0.0).remat == "dots"  # explicit: kept


@skip_if_not_enough_devices(2)
@pytest.mark.slow
def test_the_rl_step_resolves_auto_and_logs_why(caplog):
  """A tiny model whose every estimate is over a tiny budget: the step compiles with full and warns."""
  from vcpo_jax.learner import config as learner_config, optimizer as optimizer_lib
  cfg = model_config.ModelConfig(remat="auto", remat_budget_gb=1e-9, scan_layers=True, max_seq_len=16)
  mesh = sharding.make_mesh(dict(data=1, fsdp=2, tensor=1), devices=jax.devices()[:2])
  with caplog.at_level(logging.INFO):
    _, chosen, _ = _compile(cfg, learner_config.LearnerConfig(), optimizer_lib.build_optimizer(learning_rate=1e-3),
                            mesh, 4, 16)
  assert chosen == "full"
  assert any("model.remat=auto -> 'full' (no policy fits" in r.getMessage() for r in caplog.records)


def test_full_remat_keeps_one_hidden_state_per_layer_and_token():
  """Independent truth for the residual count: under full remat a layer keeps only its input [rows, T, D]."""
  cfg = model_config.ModelConfig(remat="full", dtype="bfloat16", max_seq_len=32)
  per_layer = remat.residual_bytes(cfg, 2, 3, 32) - remat.residual_bytes(cfg, 1, 3, 32)
  assert per_layer == 3 * 32 * cfg.hidden_size * 2


def test_remat_budget_is_validated():
  with pytest.raises(ValueError, match="model.remat_budget_gb"):
    model_config.ModelConfig(remat_budget_gb=-1)


if __name__ == "__main__":  # the figures: python tests/test_remat_auto.py [size ...] (every policy, then auto)
  logging.basicConfig(level=logging.INFO)
  for size, t in ALL_CASES:
    if len(sys.argv) > 1 and size not in sys.argv[1:]:
      continue
    cfg, lc, opt, mesh, rows = _case(size, t)
    for policy in remat.ORDER + ("auto",):
      try:
        gb, chosen, est = _compile(dataclasses.replace(cfg, remat=policy), lc, opt, mesh, rows, cfg.max_seq_len)
        print(f"{size} T={cfg.max_seq_len} rows={rows} over {mesh.devices.size} devices, remat={policy}->{chosen}:"
              f" XLA {gb:.2f} GB per device, estimate {est:.2f} GB", flush=True)
      except Exception as e:  # noqa: BLE001 - one policy failing to compile must not lose the others
        print(f"{size} T={cfg.max_seq_len} remat={policy}: {type(e).__name__}: {str(e)[:200]}", flush=True)
