"""CPU-only stand-in for sgl_kernel: importable, and every kernel raises when called (install_sglang_cpu.sh)."""
# SGLang's CPU engine imports sgl_kernel at start-up, but its compiled CPU kernels are not on PyPI. SGLang
# decides whether to use them with `hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`
# (sglang/srt/utils/common.py, _is_intel_amx_backend_available): this module registers no torch ops, so that is
# False and a dense Qwen2 served with --attention-backend torch_native --sampling-backend pytorch stays on
# plain torch. Any kernel that is called anyway fails loudly, never silently.
__version__ = "0.0.0+vcpo-cpu-stub"


def __getattr__(name: str):
  if name.startswith("__"):
    raise AttributeError(name)

  def _missing(*args, **kwargs):
    raise NotImplementedError(f"sgl_kernel.{name} is not available in the CPU stub (vcpo_jax third_party)")

  return _missing
