"""The memory matrix (section `memory`): the trainer's memory check (trainer/memory/check.py) on each preset x
fine-tuning (full, LoRA) x remat setting of the seed-shaped GRPO step, before any work.

Each cell builds the run's states as shapes and compiles its step's programs, as `TrainerWorker` does before
loading weights: nothing is allocated, so a cell takes its compile time and the device's limit (or
--device_limit_gb). Rows: `memory` (one a cell: `fits` with the largest program and what it needs, or
`refused` with the check's error) and `memory_programs` (every compiled program of a cell that fits).
Whether the cells that fit also run is the `e2e` section's to show (benchmarks/sessions/memory_matrix.sh
runs a few). On a CPU, XLA's analysis differs from a GPU's (bf16 matmuls run in fp32, attention is XLA's),
so CPU verdicts are not the GPU's.
"""

from __future__ import annotations

import dataclasses
import time

from jaxrl_llm.bench.harness import TRAINER_MEM_FRACTION, emit, option, section
from jaxrl_llm.bench.workload import make_run

option("--fine_tuning", default="full,lora", help="memory: full fine-tuning and/or LoRA (rank --lora_rank)")
option("--remats", default="full,dots,auto", help="memory: the model.remat settings of the matrix")
option("--int8_presets", default="qwen2p5_14b", help="memory: presets whose LoRA cells hold the base in int8")
option("--device_limit_gb", type=float, help="memory: the limit to check against (default: the device's; a CPU "
       "has none)")

MATRIX = "qwen2p5_1p5b,qwen2p5_7b,qwen3_8b,llama3p1_8b,qwen2p5_14b"


@section("memory", help="the memory check's verdict (XLA's compiled programs against the device, before any work) "
         "for preset x full/LoRA x remat: the memory matrix", mem_fraction=TRAINER_MEM_FRACTION,
         defaults={"train_presets": MATRIX, "token_budget": 16384, "lora_rank": 32, "prompts_per_gpu": 128})
def memory(opts):
    from jaxrl_llm.errors import DeviceMemoryError
    from jaxrl_llm.trainer.memory import check as memory_check
    from jaxrl_llm.trainer.roles.model_load import model_config
    from jaxrl_llm.trainer.roles.worker import TrainerWorker

    def build(run, cfg):
        return TrainerWorker(run, total_steps=10, model_cfg=cfg, abstract=True)

    presets = [opts.small_preset] if opts.small else opts.train_presets.split(",")
    for preset in presets:
        for mode in opts.fine_tuning.split(","):
            rank = opts.lora_rank if mode == "lora" else 0
            quant = "int8" if rank and preset in opts.int8_presets.split(",") else "none"
            for remat in opts.remats.split(","):
                n_prompts, n = (8, 2) if opts.small else (opts.prompts_per_gpu, 5)
                run = make_run(preset, prompts=n_prompts, n=n, mini=n_prompts // 4, budget=opts.token_budget,
                               remat=remat, small=opts.small, max_response=64 if opts.small else 1024,
                               max_prompt=64 if opts.small else 512, lora_rank=rank, base_quantization=quant)
                if opts.device_limit_gb:
                    run = dataclasses.replace(run, trainer=dataclasses.replace(
                        run.trainer, device_memory_limit_bytes=int(opts.device_limit_gb * 1e9)))
                cell = dict(preset=preset, fine_tuning=mode, lora_rank=rank, base_quantization=quant, remat=remat)
                t0 = time.perf_counter()
                try:
                    plan = memory_check.plan(run, model_config(run), build)
                except DeviceMemoryError as e:
                    emit(section="memory", **cell, verdict="refused", seconds=time.perf_counter() - t0, error=str(e))
                    continue
                if plan.limit is None:
                    emit(section="memory", **cell, verdict="no limit (a CPU: pass --device_limit_gb)")
                    continue
                top = max(plan.programs, key=lambda p: p.need)
                emit(section="memory", **cell, verdict="fits", remat_used=plan.cfg.remat,
                     logprob_budget=plan.run.rollout.log_prob_max_token_len_per_gpu, largest=top.name,
                     need_gb=round(top.need / 1e9, 2), limit_gb=round(plan.limit / 1e9, 2),
                     seconds=time.perf_counter() - t0)
                for row in plan.rows():
                    emit(section="memory_programs", **cell, **row)
