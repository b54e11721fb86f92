"""The benchmarks: one harness (`harness.py`), many sections, one command.

    python -m jaxrl_llm.bench --sections e2e --train_presets qwen2p5_7b --lora_rank 32 --token_budget 16384
    python -m jaxrl_llm.bench --sections list          # every section, what it measures, its defaults

A section is a function registered with `@section(name, help=..., defaults=...)` in one of the modules
below; its options are declared with `option(...)` (shared ones in harness.py). Adding one: write the
function in the module of its kind (or a new module, then import it here), emit its rows with `emit`.
`scripts/gpu_check.py` runs a list of them against recorded figures (`check.py`, benchmarks/baselines.json).

  model         ceilings, attention, parity, logprob
  gen           rollout, gen, long, seed_gen (gen and long on one GPU or several: --devices 1,2)
  shards        shards_check (the paged engine's shards on every mesh of the GPUs against one GPU)
  decode        decode_ceilings, decode_attention, sampling, decode_profile
  train         train, e2e, profile_update
  memory        memory (XLA's compiled memory of a run's step, the memory matrix)
  weights       sync, weights_checkpoint, weight_path
  state_checkpoint  checkpoint (the trainer's full-state checkpoint: the step's wait, the async write, restore)
  sync_split    sync_split (async training's weight sync, training mesh -> rollout mesh on other devices)
  sync_processes  sync_processes (the same from a training process to a rollout process; under the launcher)
  async_rl      async_longtail (one_step_off and fully_async against the synchronous step, long-tailed lengths)
  lora_sync     lora_sync;  quant: quant;  moe: moe_grouped, moe_update, moe_decode
  decode_kernel, paged_kernel   the Pallas decode kernels alone
  torch_peers   torch (transformers peers and the parity reference; a command of its own)
  tools         tools (the agent loop's tool runner and sandbox)
"""

from jaxrl_llm.bench import (  # noqa: F401  (each registers its sections)
    async_rl,
    decode,
    decode_kernel,
    gen,
    lora_sync,
    memory,
    model,
    moe,
    paged_kernel,
    quant,
    shards,
    state_checkpoint,
    sync_processes,
    sync_split,
    tools,
    torch_peers,
    train,
    weights,
)
