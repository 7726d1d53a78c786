"""CPU-only torch has no pinned memory: SGLang 0.5.23's LoRA asks for it anyway (sglang#31894); here it is a no-op.

Loaded at interpreter start by vcpo_sglang_cpu_pin.pth (install_sglang_cpu.sh puts both into the SGLang CPU
venv), and only when SGLANG_USE_CPU_ENGINE=1 and torch sees no CUDA device. Pinning only makes host-to-device
copies asynchronous; with no device it has nothing to do, so the tensor itself (or an unpinned new one) is
exactly what the caller computes with. Sites: `pin_memory=True` in lora/layers.py and lora/backend/*.py, and
`.pin_memory()` in lora/lora.py and lora/backend/torch_backend.py.
"""
import functools
import os


def _install() -> None:
  import torch
  if torch.cuda.is_available():
    return

  def pin_memory(self, *args, **kwargs):
    return self
  torch.Tensor.pin_memory = pin_memory
  for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_strided"):
    factory = getattr(torch, name)

    @functools.wraps(factory)
    def unpinned(*args, _factory=factory, pin_memory=False, **kwargs):
      return _factory(*args, **kwargs)
    setattr(torch, name, unpinned)


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and os.environ.get("VCPO_SGLANG_CPU_PIN", "1") == "1":
  _install()
