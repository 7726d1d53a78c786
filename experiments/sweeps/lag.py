"""Stability versus lag: VCPO and plain sequence-TIS under in-process lag emulation, k = 0 .. 128."""


def get_sweep(arg: str = "") -> list[dict]:
  lags = [int(x) for x in arg.split(",")] if arg else [0, 2, 8, 32, 128]
  units = []
  for k in lags:
    common = {"rl.mode": "emulate", "rl.max_lag": k}
    units.append({"name": f"vcpo_k{k}", **common})
    units.append({"name": f"seq_tis_k{k}", **common, "algo.advantage": "grpo", "algo.ess.enabled": False})
  return units
