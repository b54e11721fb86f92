"""`checkpoint`: the trainer's own checkpoint of its full train state, saved and restored as a run does it (the
7B state, bf16 weights with fp32 master and AdamW moments, is about 91 GB).

    python -m jaxrl_llm.bench --sections checkpoint --train_presets qwen2p5_7b [--work_dir /tmp] [--repeats 2]
    JAX_PLATFORMS=cpu python -m jaxrl_llm.bench --sections checkpoint --small      # the tiny preset on a CPU

For each preset, a TrainerWorker over every visible device (fsdp), then --repeats times:
  save_call_s  `save_checkpoint`, what a training step waits for: the states copied to host memory (Orbax then
               writes them on its own thread while the next steps run)
  commit_s     from the call's return to the checkpoint committed (`wait_checkpoint`): the disk write
  restore_s    `RunCheckpointer.restore` of it into the same layout, as a resumed run restores
and the bytes on disk, the write and read rates, and whether the restored state equals the saved one. The
checkpointer keeps one checkpoint (max_to_keep 1): while a save is in flight the disk holds two, which for the 7B
is ~182 GB; the trainer's default of 2 kept needs three while saving (row `disk_while_saving_gb`).
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import jax.numpy as jnp

from jaxrl_llm.bench.harness import TRAINER_MEM_FRACTION, emit, scratch_dir, section
from jaxrl_llm.bench.workload import dir_bytes, make_run


@section("checkpoint", help="save (the step's wait, then the async write) and restore of the trainer's full state",
         defaults={"train_presets": "qwen2p5_7b", "repeats": 2, "remat": "full"}, mem_fraction=TRAINER_MEM_FRACTION)
def checkpoint_section(opts):
    from jaxrl_llm.trainer.roles.worker import TrainerWorker

    for preset in [opts.small_preset] if opts.small else opts.train_presets.split(","):
        run = make_run(preset, prompts=8, n=2, mini=8, budget=2048, remat=opts.remat.split(",")[0],
                       small=opts.small, max_response=64, max_prompt=64)
        worker = TrainerWorker(run, total_steps=10)
        state = (worker.actor_state, worker.critic_state)
        state_gb = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e9
        root = scratch_dir("ckpt_bench_", opts.work_dir)
        try:
            worker.open_checkpointer(root, max_to_keep=1)
            for rep in range(opts.repeats):
                step = rep + 1
                t0 = time.perf_counter()
                worker.save_checkpoint(step, {"step": step})
                t1 = time.perf_counter()
                worker.wait_checkpoint()
                t2 = time.perf_counter()
                disk = dir_bytes(os.path.join(root, str(step))) / 1e9
                t3 = time.perf_counter()
                actor, critic, _ = worker.ckpt.restore(step, actor=state[0], critic=state[1])
                jax.block_until_ready((actor, critic))
                restore_s = time.perf_counter() - t3
                equal = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves((actor, critic)),
                                                                         jax.tree.leaves(state)))
                del actor, critic
                emit(section="checkpoint", preset=preset, rep=rep, devices=jax.device_count(), state_gb=state_gb,
                     save_call_s=t1 - t0, commit_s=t2 - t1, disk_gb=disk, write_gbps=disk / (t2 - t0),
                     restore_s=restore_s, read_gbps=disk / restore_s, restored_equal=equal,
                     disk_while_saving_gb=3 * disk, disk_free_gb=shutil.disk_usage(root).free / 1e9)
            worker.close_checkpointer()
        finally:
            shutil.rmtree(root, ignore_errors=True)
        del worker, state
