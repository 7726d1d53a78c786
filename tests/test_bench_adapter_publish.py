"""benchmarks/cpu/bench_adapter_publish.py without a server: the adapter's bytes, its random versions, figures."""
import jax
import numpy as np

from benchmarks.cpu import bench_adapter_publish as bench
from vcpo_jax.model import config as model_config


def test_the_7b_adapter_bytes_are_rank_times_in_plus_out_over_every_linear_layer():
  # Qwen2.5-7B: hidden 3584, MLP 18944, 28 heads and 4 KV heads of 128, 28 layers (written out by hand).
  h, f, q, kv = 3584, 18944, 28 * 128, 4 * 128
  per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h)
  assert bench.adapter_bytes("7b", 16, 2) == 16 * per_layer * 28 * 2  # ~81 MB in bf16, as the issue says
  assert 80e6 < bench.adapter_bytes("7b", 16, 2) < 82e6


def test_random_adapters_differ_per_version_and_have_nonzero_B():
  cfg = model_config.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                                 num_kv_heads=1, head_dim=8, max_seq_len=16)
  lora_cfg = model_config.LoraConfig(rank=4, alpha=8.0)
  a, b = (bench.random_adapter(cfg, lora_cfg, v) for v in (1, 2))
  leaves_a = jax.tree_util.tree_leaves_with_path(a)
  assert all(np.abs(np.asarray(x)).max() > 0 for p, x in leaves_a if "lora_B" in str(p[-1]))
  assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_figures_carry_seconds_per_mb_to_the_7b_adapter():
  m = {"rank": 16, "shape": "0.5b", "server_dtype": "bfloat16",
       "transports": {"disk": {"bytes_sent": 35_000_000, "rounds": [{"publish_s": s} for s in (0.3, 0.35, 0.4)]}}}
  figs = {f["key"]: f for f in bench.figures(m)}
  assert figs["disk_publish_s"]["value"] == 0.35 and figs["disk_publish_s"]["goal_met"] is False
  seven_b_mb = bench.adapter_bytes("7b", 16, 4) / 1e6  # the r = 16, whatever rank ran
  assert np.isclose(figs["disk_publish_7b_s"]["value"], 0.35 / 35.0 * seven_b_mb)
