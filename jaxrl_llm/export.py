"""`python -m jaxrl_llm.export --checkpoint RUN_DIR[/checkpoints/STEP] --out DIR [--dtype bfloat16] [--merge]`

Writes the actor of a run checkpoint as a HF directory (config.json, safetensors, generation config,
the run's tokenizer) that transformers and vLLM load, for any supported family (the checkpoint keeps
the model's HF config). With `--critic` it writes the critic as the family's `*ForTokenClassification`
instead. A LoRA run's actor is written as a PEFT adapter directory (adapter_config.json +
adapter_model.safetensors) for the base it was trained on, its critic as a PEFT TOKEN_CLS directory
(the value head in modules_to_save); `--merge` writes the base with the adapters merged in as a full HF
directory instead; with an 8-bit base (`model.base_quantization`) the merged kernels are the dequantized
base plus the adapters, so they carry the base's quantization error (the model the run trained). Parameters
are restored on the host, so no accelerator is needed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import jax
import orbax.checkpoint as ocp

from jaxrl_llm.checkpoint import NoValidCheckpointError, RunCheckpointer, resolve_resume
from jaxrl_llm.models import init_params, load_params, quant
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.hf_io import copy_tokenizer, is_critic_checkpoint, write_hf_dir
from jaxrl_llm.models.lora import LoraSpec, is_adapter, merge_adapters, partition
from jaxrl_llm.models.peft_io import save_peft
from jaxrl_llm.trainer.processes.process import setup_logging

log = logging.getLogger(__name__)


def _host_target(metadata):
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu), metadata)


def load_checkpoint_params(checkpoint: str, *, critic: bool = False):
    """(step, params on the host, DecoderConfig, run dir) of a run checkpoint (the latest valid one when
    `checkpoint` is a run dir or a checkpoints dir); a LoRA run's params are its trained leaves."""
    return load_checkpoint(checkpoint, critic=critic)[:4]


def load_checkpoint(checkpoint: str, *, critic: bool = False):
    """`load_checkpoint_params` and the checkpoint's meta."""
    directory, step = resolve_resume(checkpoint, checkpoint)
    ckpt = RunCheckpointer(directory, read_only=True)
    steps = ckpt.steps() if step is None else [step]
    if not steps or (step is not None and step not in ckpt.steps()):
        raise NoValidCheckpointError(f"--checkpoint {checkpoint}: no checkpoint there (found steps {ckpt.steps()})")
    item = "critic" if critic else "actor"
    errors = []
    for s in reversed(steps):
        try:
            meta = ckpt.manager.item_metadata(s)
            if meta.get(item) is None:
                raise NoValidCheckpointError(f"step {s} has no {item}")
            # The whole train state is read (params and optimizer moments: about 3x the params in host
            # memory); the params are kept.
            args = ocp.args.StandardRestore(_host_target(meta[item]))
            out = ckpt.manager.restore(s, args=ocp.args.Composite(**{item: args, "meta": ocp.args.JsonRestore()}))
            run_dir = os.path.dirname(ckpt.directory)
            meta = dict(out["meta"])
            return s, out[item]["params"], DecoderConfig.from_hf(dict(meta["model"])), run_dir, meta
        except NoValidCheckpointError:
            raise
        except Exception as e:  # a corrupted step: try the one before, as resume does
            errors.append(f"step {s}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            log.warning("checkpoint %s", errors[-1])
    raise NoValidCheckpointError(f"--checkpoint {checkpoint}: no checkpoint restores ({'; '.join(errors)})")


def export(checkpoint: str, out_dir: str, *, dtype: str | None = None, critic: bool = False,
           tokenizer_dir: str | None = None, max_shard_size: str = "5GB", merge: bool = False) -> str:
    """Writes the checkpoint's actor (or critic) as a HF directory, or a LoRA run's as a PEFT directory.

    dtype: the tensors' dtype; None keeps the run's `model.dtype` (bfloat16 for checkpoints older than
    that record). A PEFT export of a run on a random preset writes that base as a HF directory in
    `<out_dir>/base` and names it (absolute) in `base_model_name_or_path`, so
    `AutoPeftModelForCausalLM.from_pretrained(out_dir)` loads the pair offline.
    """
    step, params, cfg, run_dir, meta = load_checkpoint(checkpoint, critic=critic)
    dtype = dtype or run_dtype(meta)
    tok = tokenizer_dir or os.path.join(run_dir, "tokenizer")
    tok = tok if os.path.isdir(tok) else None
    lora = meta.get("lora")
    what = "the critic" if critic else "the actor"
    if lora and not merge:
        spec = LoraSpec(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]))
        adapters, head = partition(params, is_adapter)
        base = _base_path(lora, critic)
        if base is None:  # a random preset: write it, so the adapter has a base that loads offline
            base = os.path.abspath(os.path.join(out_dir, "base"))
            write_hf_dir(base_params(cfg, lora, critic=critic), cfg, base, critic=critic, tokenizer_dir=tok,
                         dtype=dtype, max_shard_size=max_shard_size)
        elif os.path.isdir(base):  # a local dir: absolute, so the adapter loads from any working directory
            base = os.path.abspath(base)
        save_peft(adapters, spec, out_dir, cfg, base_model=base, dtype=dtype,
                  head=head.get("score") if critic else None)
        if tok:  # AutoPeftModel reads the tokenizer beside the adapter (else it asks the hub)
            copy_tokenizer(tok, out_dir)
        log.info("exported the LoRA adapters of %s, step %d of %s, to %s (%s tensors: %s; --dtype to change), "
                 "base %s", what, step, checkpoint, out_dir, dtype, _dtype_source(meta, dtype), base)
        return out_dir
    if lora:
        params = merged_params(params, cfg, lora, critic=critic)
    write_hf_dir(params, cfg, out_dir, critic=critic, tokenizer_dir=tok, dtype=dtype, max_shard_size=max_shard_size)
    log.info("exported %s, step %d of %s, to %s (%s tensors: %s; --dtype to change)", what, step, checkpoint,
             out_dir, dtype, _dtype_source(meta, dtype))
    return out_dir


def run_dtype(meta: dict) -> str:
    """The run's compute dtype (`model.dtype`) as its checkpoint recorded it; bfloat16 for older ones."""
    return meta.get("dtype") or (meta.get("lora") or {}).get("dtype") or "bfloat16"


def _dtype_source(meta: dict, dtype: str) -> str:
    if meta.get("dtype") or (meta.get("lora") or {}).get("dtype"):
        return "the run's model.dtype" if dtype == run_dtype(meta) else f"the run's model.dtype was {run_dtype(meta)}"
    return "the checkpoint does not record the run's dtype"


def _base_path(lora: dict, critic: bool) -> str | None:
    """The HF directory a LoRA run's actor (or critic: `model.critic_path`, else the actor's) started from."""
    return (lora.get("critic_path") if critic else None) or lora["path"]


def base_params(cfg: DecoderConfig, lora: dict, *, critic: bool = False) -> dict:
    """A LoRA run's frozen base in fp32 on the host: its HF dir, or its random preset re-drawn from the seed."""
    path = _base_path(lora, critic)
    if path is not None:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--merge: the run's base model {path!r} is not a directory here; "
                                    "export without --merge (a PEFT directory) or run where the base is")
        return load_params(path, cfg, critic=critic and is_critic_checkpoint(path))
    # the trainer draws a critic's preset from seed + 1 (trainer/roles/model_load.py)
    return init_params(cfg.replace(param_dtype=lora["param_dtype"]), seed=lora["seed"] + int(critic), critic=critic)


def merged_params(trained: dict, cfg: DecoderConfig, lora: dict, *, critic: bool = False) -> dict:
    """The run's base (`base_params`) with the adapters merged in, in fp32 on the host; a critic keeps its
    trained value head."""
    spec = LoraSpec(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]))
    adapters, head = partition(trained, is_adapter)
    base = base_params(cfg, lora, critic=critic)
    kind = lora.get("base_quantization", "none")
    if kind == "none":
        merged = merge_adapters(base, adapters, spec, jax.numpy.float32)
    else:  # the base the run trained on: cast to its compute dtype and quantized the same way (deterministic)
        dt = jax.numpy.dtype(lora["dtype"])
        merged = jax.jit(lambda b, a: quant.merged_base(
            quant.quantize_base(jax.tree.map(lambda x: x.astype(dt), b), kind), a, spec.scale,
            jax.numpy.float32))(base, adapters)
    return {"model": merged["model"], "score": head["score"]} if critic else merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_llm.export", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="RUN_DIR, RUN_DIR/checkpoints or RUN_DIR/checkpoints/STEP")
    ap.add_argument("--out", required=True, help="output HF directory")
    ap.add_argument("--dtype", default=None, help="tensor dtype in the export (float32, bfloat16); default: the "
                    "run's model.dtype")
    ap.add_argument("--critic", action="store_true", help="export the critic (value model) instead")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the run's saved tokenizer)")
    ap.add_argument("--merge", action="store_true", help="LoRA run: write the base with the adapters merged in "
                    "(a full HF directory) instead of a PEFT adapter directory")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging("INFO")  # our lines at INFO; absl's (Orbax's) and JAX's backend probing only from WARNING
    try:
        out = export(args.checkpoint, args.out, dtype=args.dtype, critic=args.critic, tokenizer_dir=args.tokenizer,
                     merge=args.merge)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
