"""CPU-only stand-in for sgl_kernel: importable, every kernel raises when called (see install_sglang_cpu.sh)."""
# SGLang's CPU engine imports sgl_kernel at start-up, but the compiled CPU kernels are not on PyPI. A dense Qwen2
# served with --attention-backend torch_native and --sampling-backend pytorch never calls them: the packed-weight
# (AMX) paths are switched off when `convert_weight_packed` is missing, which a module-level __getattr__ that
# raises AttributeError for it would say; here it returns a callable that raises, and SGLang probes with hasattr
# on the ops namespace instead, so both paths stay on torch. Any real call fails loudly, never silently.
__version__ = "0.0.0+vcpo-cpu-stub"


def __getattr__(name: str):
  if name.startswith("__"):
    raise AttributeError(name)

  def _missing(*args, **kwargs):
    raise NotImplementedError(f"sgl_kernel.{name} is not available in the CPU stub (vcpo_jax third_party)")

  return _missing
