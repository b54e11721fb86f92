"""The vLLM pool's weight update on a CPU: through a HF directory versus from host memory.

  python scripts/bench_weight_path.py [--preset qwen2p5_0p5b] [--repeats 3] [--dir /tmp]

Builds random bf16 weights of a preset (never zeros: HF's normal init), saves them with
`weights_io.save_weights` as the trainer does, starts one `VllmActor` (no Ray) from the checkpoint
and times, `--repeats` times each:
  save    save_weights (the trainer's side)
  files   load_weights(via_files=True): Orbax restore, write_hf_dir, vLLM reload from the files
  memory  load_weights(): Orbax restore, vLLM reload from the tensors in host memory
  convert the memory path without vLLM: Orbax restore and the HF table's tensors as torch tensors
          (`iter_hf_tensors`: renames, casts and transposes), i.e. what the memory path's
          "reload_s" spends before vLLM's own work
Prints one JSON row per measurement, then the medians (each key's own). Greedy tokens and logprobs
after a files load and after a memory load are compared (they must be equal).
Qwen2.5-0.5B takes under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A pool actor's environment (`vllm_worker.DEFAULT_ENV`), set before jax reads it at import.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from scripts.bench_common import dir_bytes, emit  # noqa: E402


def _greedy(actor, prompts):
    request = dict(n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=8, stop_token_ids=(),
                   ignore_eos=True, seeds=[0] * len(prompts))
    return [r[0][:2] for r in actor.generate(prompts, request)]  # (tokens, logprobs) per prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2p5_0p5b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoint and HF dirs go (default: temp dir)")
    parser.add_argument("--kv_cache_mb", type=int, default=64)
    args = parser.parse_args()

    import jax

    from jaxrl_llm.models import PRESETS, init_params
    from jaxrl_llm.models.hf_io import iter_hf_tensors
    from jaxrl_llm.rollout.vllm_worker import VllmActor, _as_torch
    from jaxrl_llm.weights_io import restore_weights, save_weights

    cfg = PRESETS[args.preset](dtype="bfloat16", param_dtype="bfloat16")
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_params(cfg, seed=0))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    emit(what="init", preset=args.preset, params=sum(x.size for x in jax.tree.leaves(params)), bytes=nbytes,
         seconds=time.perf_counter() - t0)

    root = tempfile.mkdtemp(prefix="bench_weight_path_", dir=args.dir)
    weights_dir = os.path.join(root, "weights")
    rows: dict[str, list[dict]] = {"save": [], "files": [], "memory": [], "convert": []}
    try:
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            save_weights(weights_dir, rep + 1, params, cfg)
            row = dict(what="save", rep=rep, seconds=time.perf_counter() - t0)
            rows["save"].append(row)
            emit(**row)
        step = args.repeats
        emit(what="checkpoint", step=step, bytes_on_disk=dir_bytes(os.path.join(weights_dir, str(step))))
        del params

        t0 = time.perf_counter()
        actor = VllmActor(None, weights_dir, step, dtype="bfloat16", max_model_len=256, scratch_dir=root,
                          engine_kwargs=dict(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mb << 20,
                                             max_num_seqs=4, max_num_batched_tokens=256))
        emit(what="engine_start", seconds=time.perf_counter() - t0)

        prompts = [[9707, 11, 1879, 0], [785, 6722, 315, 9625, 374]]
        outputs = {}
        for rep in range(args.repeats):  # interleaved, so both paths see the same page cache
            for what, via_files in (("files", True), ("memory", False)):
                t0 = time.perf_counter()
                timings = actor.load_weights(weights_dir, step, via_files=via_files)
                row = dict(what=what, rep=rep, seconds=time.perf_counter() - t0, **timings)
                rows[what].append(row)
                emit(**row)
                if rep == args.repeats - 1:
                    outputs[what] = _greedy(actor, prompts)
            t0 = time.perf_counter()
            _, restored, restored_cfg = restore_weights(weights_dir, step)
            t1 = time.perf_counter()
            for _, arr in iter_hf_tensors(restored, restored_cfg, dtype="bfloat16"):
                _as_torch(arr)
            row = dict(what="convert", rep=rep, seconds=time.perf_counter() - t0, restore_s=t1 - t0,
                       convert_s=time.perf_counter() - t1)
            del restored
            rows["convert"].append(row)
            emit(**row)
        same = outputs["files"] == outputs["memory"]
        emit(what="greedy_equal", equal=same, tokens=[t for t, _ in outputs["memory"]])
        if not same:
            raise SystemExit(f"the two load paths generate differently: {outputs}")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    for what, rs in rows.items():
        keys = [k for k in rs[0] if k not in ("what", "rep")]
        emit(what=f"median/{what}", repeats=len(rs), bytes=nbytes,
             **{k: statistics.median(r[k] for r in rs) for k in keys})


if __name__ == "__main__":
    main()
