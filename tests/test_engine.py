"""rollout.engine: the decode loop outlives a failure (its rows end as aborts, later requests are served)."""
import asyncio

import jax
import pytest

from tests import waits
from vcpo_jax.model import config as model_config
from vcpo_jax.model import sampling
from vcpo_jax.model import transformer as M
from vcpo_jax.serving import engine as engine_lib

CFG = model_config.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, max_seq_len=32)


def _row(rid: str, n: int = 6) -> engine_lib.Row:
  return engine_lib.Row(spec=sampling.RowSpec(prompt=(1, 2, 3), max_new_tokens=n, ignore_eos=True, seed=1),
                        rid=rid)


@pytest.mark.slow
def test_loop_survives_a_failure_and_pause_still_returns():
  params = M.init_params(CFG, jax.random.PRNGKey(0))

  async def run():
    eng = engine_lib.Engine(params, CFG, "v0", max_batch=4, chunk_steps=2, min_batch=1, min_prompt_len=4)
    eng.start()
    settle, calls = eng._settle, {"n": 0}

    def failing_once():
      calls["n"] += 1
      if calls["n"] == 3:  # after the row joined: the loop's own book-keeping raises
        raise RuntimeError("injected")
      settle()

    eng._settle = failing_once
    first = _row("a")
    eng.submit([first])
    await waits.wait_for(first.done.wait(), 120, "the first row, aborted by the failing loop")
    assert first.finish_reason == "abort" and calls["n"] >= 3
    second = _row("b")
    eng.submit([second])
    await waits.wait_for(second.done.wait(), 120, "the second row on the restarted loop")
    assert second.finish_reason == "length" and len(second.output_ids) == 6
    assert await waits.wait_for(eng.pause("abort"), 30, "the loop to park on pause") == 0  # a dead loop would never park
    eng.resume()
    await eng.stop()

  asyncio.run(run())
