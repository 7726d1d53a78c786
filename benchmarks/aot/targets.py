"""Deviceless targets: GPUs from a target description, TPU slices from libtpu's topologies, and their Target."""
from __future__ import annotations

import os
import re

from vcpo_jax.parallel import target as target_lib

HERE = os.path.dirname(os.path.abspath(__file__))
# Target descriptions shipped with the wing (GpuTargetConfigProto text).
GPU_SPECS = {"h100": os.path.join(HERE, "h100_sxm.txtpb")}


def gpu_spec_text(spec: str) -> str:
  if spec not in GPU_SPECS and not os.path.exists(spec):
    raise ValueError(f"--gpu must be one of {sorted(GPU_SPECS)} or a GpuTargetConfigProto file, got {spec!r}")
  with open(GPU_SPECS.get(spec, spec)) as f:
    return f.read()


def gpu_devices(spec: str = "h100", count: int = 1) -> tuple[list, target_lib.Target]:
  """`count` GPUs of one host described by `spec` (compile-only devices: the CUDA plugin, no driver needed)."""
  from jax.experimental import topologies
  text = gpu_spec_text(spec)
  topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology=f"1x1x{count}")
  memory = re.search(r"device_memory_size:\s*(\d+)", text)
  name = re.search(r'device_description_str:\s*"([^"]+)"', text)
  devices = list(topo.devices)
  kind = name.group(1) if name else devices[0].device_kind
  return devices, target_lib.Target("gpu", kind, int(memory.group(1)) if memory else None)


def tpu_devices(slice_name: str) -> tuple[list, target_lib.Target]:
  """The chips of a TPU slice: "v5e:2x2" (all four), or "v5p:2x2x1/1" (the first chip of it: one chip alone).
  The Target's memory is the chip's HBM (target.HBM_BYTES_BY_KIND)."""
  # No chip is opened: libtpu's one-process lock (it guards real chips) would keep two compiles (a test beside a
  # run) apart, and with no TPU host there are no workers to look up.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  from jax.experimental import topologies
  name, _, first = slice_name.partition("/")
  devices = list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
  if first:
    devices = devices[:int(first)]
  t = target_lib.from_device(devices[0])
  if not t.memory_bytes:
    raise ValueError(f"no HBM size known for device kind {t.device_kind!r} of slice {slice_name!r}: add it to "
                     "vcpo_jax/parallel/target.py HBM_BYTES_BY_KIND")
  return devices, t
