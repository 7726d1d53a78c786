"""The 0.5B learner step compiled for a TPU v5e 2x2 slice on this CPU (libtpu's compile-only topology): it fits
each chip's HBM with >= 10% headroom, and attention runs the splash kernel. `make test-aot` runs it in the venv
with libtpu (.venv-aot-tpu); elsewhere it is skipped, saying so."""
import pytest

pytest.importorskip("libtpu", reason="libtpu is not installed here: `make test-aot` builds .venv-aot-tpu "
                                     "(jax[tpu]) and runs this test there")

from benchmarks.aot import compile_step  # noqa: E402
from benchmarks.aot import targets  # noqa: E402

pytestmark = pytest.mark.aot_tpu


def test_the_0_5b_step_fits_a_v5e_2x2_slice_with_splash_attention():
  devices, target = targets.tpu_devices("v5e:2x2")
  assert len(devices) == 4 and target.platform == "tpu" and target.memory_bytes == 16 * 2**30
  # The GPU check's 0.5B configuration (bf16, micro-batches of 8 rows), two micro-batches of 512 tokens a row.
  result = compile_step.compile_case(compile_step.Case("qwen2.5-0.5b", "grpo", rows=16, seq_len=512), devices, target)
  assert "error" not in result, result["error"]
  mem = result["memory"]
  print(f"per chip {mem['peak_bytes'] / 1e9:.2f} GB of {target.memory_bytes / 1e9:.2f} GB, headroom "
        f"{result['headroom']:.1%}, compile {result['compile_s']:.0f} s, {result['choices']}")
  # The state alone (f32 params + Adam moments, 494M parameters, sharded over 4 chips) is ~1.5 GB per chip.
  assert mem["argument_size_in_bytes"] > 1.2e9
  assert result["fits"] and result["headroom"] >= 0.10
  assert result["attention_kernel"].startswith("Pallas"), result["custom_calls"].keys()
  assert any("remat=auto" in c and "TPU v5 lite" in c for c in result["choices"]), result["choices"]
