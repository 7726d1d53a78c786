"""The paper's ablation in small: sync vs async with each stabilizer on and off (vcpo-algorithm.md §6)."""


def get_sweep(arg: str = "") -> list[dict]:
  """`arg` sets the lag k of the async arms (default 4); each dict is one work unit's overrides."""
  k = int(arg) if arg else 4
  ess_off = {"algo.ess.enabled": False}
  return [
      {"name": "sync_vcpo", "rl.max_lag": 0},
      {"name": f"k{k}_seq_tis", "rl.max_lag": k, "algo.advantage": "grpo", **ess_off},
      {"name": f"k{k}_ess_only", "rl.max_lag": k, "algo.advantage": "grpo"},
      {"name": f"k{k}_opob_only", "rl.max_lag": k, **ess_off},
      {"name": f"k{k}_vcpo", "rl.max_lag": k},
      {"name": f"k{k}_token_tis", "rl.max_lag": k, "algo.advantage": "grpo", "algo.policy_loss": "token_tis",
       **ess_off},
      {"name": f"k{k}_gspo", "rl.max_lag": k, "algo.advantage": "grpo", "algo.policy_loss": "gspo", **ess_off},
      {"name": f"k{k}_cispo", "rl.max_lag": k, "algo.advantage": "grpo", "algo.policy_loss": "cispo",
       **ess_off},
  ]
