"""benchmarks/aot: reading optimized HLO text (custom calls, largest arrays, f32 vocab arrays) and the tools'
options; the compiles themselves run in their own venvs (make aot-gpu, make test-aot)."""
import argparse

import pytest

from benchmarks.aot import cli
from benchmarks.aot import compile_step
from benchmarks.aot import hlo

# A hand-written module in the optimized-HLO text format: a fusion body (not buffers), an entry whose header
# carries "/*index=5*/" comments, a tuple-typed custom call with layout constraints and one without.
TEXT = """HloModule jit_fn, is_scheduled=true

%fused_computation (param_0: f32[64,1000]) -> f32[64,1000] {
  %param_0 = f32[64,1000]{1,0} parameter(0)
  ROOT %big_inside = f32[64,1000]{1,0} exponential(%param_0)
}

ENTRY %main.9 (p0: bf16[2,8,4,16], p1: f32[16,1000]) -> (f32[], /*index=5*/f32[]) {
  %p0 = bf16[2,8,4,16]{3,2,1,0} parameter(0)
  %p1 = f32[16,1000]{1,0} parameter(1)
  %bias = bf16[2,1,8,8]{3,2,1,0} fusion(%p0), kind=kLoop, calls=%fused_computation
  %attn = (bf16[2,4,8,16]{3,1,2,0}, u8[0]{0}) custom-call(%p0, %p0, %p0, %bias), custom_call_target="__cudnn$fmhaScaleBiasSoftmax", operand_layout_constraints={bf16[2,8,4,16]{3,2,1,0}, bf16[2,8,4,16]{3,2,1,0}, bf16[2,8,4,16]{3,2,1,0}, bf16[2,1,8,8]{3,2,1,0}}, api_version=API_VERSION_STATUS_RETURNING
  %bwd = (bf16[2,4,8,16]{3,1,2,0}, bf16[2,1,8,8]{3,2,1,0}) custom-call(%p0, %bias), custom_call_target="__cudnn$fmhaScaleBiasSoftmaxBackward"
  %logits = f32[64,1000]{1,0} fusion(%p1), kind=kOutput, calls=%fused_computation
  %logits.2 = f32[64,1000]{1,0} fusion(%p1), kind=kOutput, calls=%fused_computation
  %view = f32[64,1000]{1,0} bitcast(%logits)
  ROOT %out = (f32[], f32[]) tuple()
}
"""


def test_custom_calls_list_targets_with_operand_and_result_shapes():
  calls = hlo.custom_calls(TEXT)
  fwd = calls["__cudnn$fmhaScaleBiasSoftmax"]
  assert fwd["count"] == 1
  assert fwd["operands"] == ["bf16[2,8,4,16] bf16[2,8,4,16] bf16[2,8,4,16] bf16[2,1,8,8]"]
  assert fwd["results"] == ["bf16[2,4,8,16] u8[0]"]
  # Without layout constraints the operands are looked up by name.
  assert calls["__cudnn$fmhaScaleBiasSoftmaxBackward"]["operands"] == ["bf16[2,8,4,16] bf16[2,1,8,8]"]
  assert hlo.attention_kernel(calls) == "cuDNN fmhaScaleBiasSoftmax"
  assert hlo.attention_bias(calls) == ["bf16[2,1,8,8] (read)", "bf16[2,1,8,8] (written by the backward)"]
  assert hlo.attention_kernel({"tpu_custom_call": {}}).startswith("Pallas")
  assert hlo.attention_kernel({}).startswith("XLA")


def test_largest_arrays_are_entry_results_not_fusion_insides_or_aliases():
  top = hlo.largest_arrays(TEXT, top=2)
  assert top[0] == {"shape": "f32[64,1000]", "bytes": 64 * 1000 * 4, "count": 2, "ops": {"fusion": 2}}
  assert top[1]["shape"] == "bf16[2,4,8,16]" and top[1]["count"] == 2   # the custom calls' tuple results
  assert "bitcast" not in top[0]["ops"] and "exponential" not in top[0]["ops"]


def test_f32_vocab_arrays_leave_out_parameter_shapes():
  assert hlo.f32_vocab_arrays(TEXT, 1000, params=set()) == ["f32[64,1000]"]  # f32[16,1000]: an entry parameter
  assert hlo.f32_vocab_arrays(TEXT, 1000, params={(64, 1000)}) == []
  assert hlo.f32_vocab_arrays(TEXT, 999, params=set()) == []


def test_overrides_set_fields_and_name_bad_ones():
  config = compile_step.load_config("tiny")
  options = compile_step.apply_overrides(config, [("model.attention", "xla"), ("algo.micro_batch_size", "16"),
                                                  ("xla_gpu_enable_triton_gemm", "false")])
  assert config.model.attention == "xla" and config.algo.micro_batch_size == 16
  assert options == {"xla_gpu_enable_triton_gemm": False}
  with pytest.raises(ValueError, match="model.no_such_field"):
    compile_step.apply_overrides(config, [("model.no_such_field", "1")])
  with pytest.raises(ValueError, match="algo.micro_batch_size=eight"):
    compile_step.apply_overrides(config, [("algo.micro_batch_size", "eight")])


def test_variants_and_steps_make_one_labelled_case_each():
  parser = argparse.ArgumentParser()
  cli.add_common(parser, "grpo")
  args = parser.parse_args(["--set", "model.scan_layers=False", "--variant", "base",
                            "--variant", "xla:model.attention=xla,model.remat=full", "--steps", "grpo,job"])
  cases = cli.cases(args, "tiny", 8, 32)
  assert [c.label for c in cases] == ["base/grpo", "base/job", "xla/grpo", "xla/job"]
  assert cases[2].overrides == (("model.scan_layers", "False"), ("model.attention", "xla"), ("model.remat", "full"))
  with pytest.raises(SystemExit):
    parser.parse_args(["--steps", "sft"])


def _result(step="job", **kw):
  r = {"label": step, "config": "configs/qwen2_5.py:0.5b", "step": step, "overrides": {}, "rows": 128,
       "seq_len": 640, "micro_batch_size": 8, "dtype": "float32", "devices": 4, "mesh": {"fsdp": 4},
       "device_kind": "TPU v5 lite", "hbm_bytes": 16 * 2**30, "compile_s": 12.0, "slice": "v5e:2x2",
       "memory": {"peak_bytes": 14 * 2**30}, "headroom": 0.125, "fits": True,
       "attention_kernel": "Pallas (Mosaic) kernel", "kv_cache_bytes": 10**9,
       "choices": ["model.remat=auto -> 'dots' (~9 GB per device <= 17.2 GB)"]}
  r.update(kw)
  return r


def test_tpu_table_says_fits_only_with_ten_percent_headroom_and_names_the_remat_choice(tmp_path):
  from benchmarks.aot import tpu
  refused = _result("decode", error="XlaRuntimeError: RESOURCE_EXHAUSTED", fits=False, memory={})
  table = tpu.summary_table([_result(), _result(headroom=0.05), refused])
  rows = table.splitlines()[2:]
  assert "| 15.03 | 17.18 | 12.5% | yes |" in rows[0] and "| dots |" in rows[0]
  assert "| fits, < 10% |" in rows[1]
  assert "decode, 128 rows x 640 slots (1.00 GB KV cache)" in rows[2] and "| no: XlaRuntimeError" in rows[2]
  page = tmp_path / "tpu.md"
  page.write_text(f"intro\n{tpu.BEGIN}\nold\n{tpu.END}\nrest\n")
  tpu.update_docs(str(page), table, tpu.DEFAULT_COMMAND)
  text = page.read_text()
  assert text.startswith("intro\n") and text.endswith("rest\n") and "old" not in text and table in text
  page.write_text("no markers")
  with pytest.raises(ValueError, match="no <!-- aot-tpu table"):
    tpu.update_docs(str(page), table, tpu.DEFAULT_COMMAND)
