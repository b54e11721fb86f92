"""What runs inside one rollout actor of `VllmPool`: a `vllm.LLM` and its weight reloads.

Weights travel through host memory: each vLLM worker restores the trainer's Orbax weights
checkpoint (`weights_io.restore_weights`), renames and transposes the tensors through the one HF name
table (`models.iter_hf_tensors`) and hands them to vLLM's in-place reload as torch tensors that share
the numpy buffers (`VllmWorkerExtension.load_orbax_weights`). No HF directory is written on an
update. Files are still the way in when an engine starts (vLLM needs a model directory), and
`VllmActor.load_weights(..., via_files=True)` keeps that path for updates too: the actor writes a HF
directory (`models.write_hf_dir`) into its scratch dir and vLLM reads it back
(`collective_rpc("reload_weights", weights_path=...)`).

A LoRA run's engine (`enable_lora`) keeps the base it started from and takes each new adapter as a PEFT
directory (`VllmActor.load_adapter`): vLLM reads it into its adapter cache, every later generate carries
that `LoRARequest`, and the previous version leaves the cache (`remove_lora`). vLLM 0.32 loads adapters
from a directory only (no in-memory tensor path), so the trainer writes a few MB of PEFT files a step.

Three vLLM internals are reached through `VllmWorkerExtension`, which vLLM mixes into its worker
class (`worker_extension_cls`):

* **In-place reload from an iterator.** The worker's `reload_weights(weights_iterator=...,
  is_checkpoint_format=True)` runs the model's own `load_weights` on (HF name, tensor) pairs, then
  each layer's `process_weights_after_loading` (the CPU GEMM packing included) and copies the result
  into the existing parameter storage, as it does for a `weights_path`.
* **Tied lm_head repack.** vLLM's CPU backend packs every linear weight for its GEMM kernel when a
  layer is loaded (`dispatch_cpu_unquantized_gemm`: a oneDNN handle or an SGL packed copy, held by
  the layer's `cpu_linear` closure). An in-place reload re-runs that packing only for layers whose
  tensors were loaded. A tied lm_head loads nothing itself (a tied export of any family has no
  `lm_head.weight`): its `weight` is the embedding's tensor and holds the new values, but
  `cpu_linear` still multiplies by the old packed copy, so logits come from the old head.
  `repack_tied_lm_head` re-runs the head's `process_weights_after_loading` after each reload (a
  no-op off CPU).
* **Temperature inside the logits.** vLLM returns either raw logprobs (log softmax(logits), T = 1)
  or processed ones (after temperature *and* top-k/top-p, renormalised over the kept tokens). The
  trainer needs log softmax(logits / T) over the full vocabulary. `set_logit_scale(1 / T)` folds the
  temperature into the model's LogitsProcessor and the actor samples at temperature 1 with
  `logprobs_mode="raw_logprobs"`: vLLM then samples from exactly the distribution it would at
  temperature T (top-k/top-p act on logits / T either way) and its raw logprobs are
  log softmax(logits / T), before truncation. The only numerical difference from the trainer is
  `logits * (1 / T)` versus `logits / T` (one rounding).

Importing this module imports neither vllm nor ray; the actor imports vllm when it starts.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time

import numpy as np

DEFAULT_ENV = {
    # Restoring the Orbax checkpoint imports jax; keep it off the actor's GPUs (vLLM owns them).
    "JAX_PLATFORMS": "cpu",
    # The engine core runs in the actor's own process: no child process to orphan when the actor is
    # killed, and `collective_rpc` reaches the worker directly.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

_EXTENSION = "jaxrl_llm.rollout.vllm_worker.VllmWorkerExtension"


def _as_torch(arr: np.ndarray):
    """A CPU torch tensor on `arr`'s buffer (bf16 through a uint16 view: torch reads no ml_dtypes)."""
    import torch

    arr = np.ascontiguousarray(arr)  # a no-op for iter_hf_tensors' (fresh, C-ordered) arrays
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _hf_dtype(dtype: str) -> str | None:
    """The dtype HF tensors are cast to for an engine of `dtype` (None: keep the checkpoint's)."""
    return dtype if dtype in ("float32", "bfloat16", "float16") else None


class VllmWorkerExtension:
    """Methods vLLM mixes into its worker; called with `llm.collective_rpc(name, ...)`."""

    def _model(self):
        return self.model_runner.get_model()

    def load_orbax_weights(self, weights_dir: str, step: int, dtype: str | None) -> dict:
        """Reloads this worker's model in place from Orbax checkpoint `step`, without files.

        Each worker of the engine restores the whole checkpoint into its own host memory, so
        `weights_dir` must be readable from every worker (one host, or a shared file system), and an
        engine of W workers reads it W times; vLLM's loaders take each worker's shard of the tensors,
        as they do from a HF directory. Host memory peaks above the restored tree: vLLM holds the
        tensors of a fused layer (qkv_proj, gate_up_proj) until its last piece arrives, and the HF
        table yields row by row (every layer's q_proj, then every k_proj, ...).

        Args:
          weights_dir: the trainer's weights checkpoint directory (`weights_io.save_weights`).
          step: the checkpoint step.
          dtype: cast the HF tensors to this dtype ("bfloat16", ...) first, or None.
        Returns:
          {"restore_s": Orbax -> host numpy, "reload_s": the HF table's renames, casts and transposes,
          and vLLM's load and re-processing}.
        """
        from jaxrl_llm.models.hf_io import iter_hf_tensors
        from jaxrl_llm.weights_io import restore_weights

        t0 = time.perf_counter()
        _, params, cfg = restore_weights(weights_dir, step)
        t1 = time.perf_counter()
        tensors = ((name, _as_torch(arr)) for name, arr in iter_hf_tensors(params, cfg, dtype=dtype))
        self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
        return {"restore_s": t1 - t0, "reload_s": time.perf_counter() - t1}

    def lora_modules(self) -> list[str]:
        """The HF module names this engine's LoRA serves (fused layers expanded: qkv_proj -> q/k/v_proj)."""
        manager = self.model_runner.lora_manager._adapter_manager
        packed = manager.packed_modules_mapping
        return sorted({n for m in manager.supported_lora_modules for n in packed.get(m, [m])})

    def set_logit_scale(self, scale: float) -> None:
        """Multiplies every next-token logit by `scale` (1 / temperature) before sampling."""
        proc = getattr(self._model(), "logits_processor", None)
        if proc is None or not hasattr(proc, "scale"):
            raise RuntimeError("this vLLM model has no logits_processor.scale; cannot fold the "
                               "temperature into the logits")
        proc.scale = float(scale)

    def repack_tied_lm_head(self) -> bool:
        """Re-packs a tied lm_head from the (reloaded) embedding; returns whether it did."""
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        model = self._model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or head.weight is not embed.weight:
            return False  # untied: the head was loaded, so the reload already re-packed it
        if not isinstance(head.quant_method, UnquantizedEmbeddingMethod):
            return False  # quantized heads are processed from their own tensors
        head.quant_method.process_weights_after_loading(head)
        return True

    def repack_moe_experts(self) -> int:
        """Re-packs the experts of every MoE layer on vLLM CPU; returns how many layers it re-packed.

        vLLM CPU prepacks each FusedMoE layer's w13 / w2 into its grouped-GEMM layout when the model is
        first loaded (`CPUUnquantizedExperts.process_weights_after_loading`). An in-place reload copies the
        new weights, in checkpoint layout, into the prepacked tensors and skips that step (vLLM runs it on
        the first load only), so every expert computes with scrambled weights until it is packed again.
        Elsewhere (CUDA's fused MoE kernels read the plain layout) there is nothing to do.
        """
        try:
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        except ImportError:  # a vLLM build without the CPU experts
            return 0
        count = 0
        for module in self._model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                experts.process_weights_after_loading(module)
                count += 1
        return count

    def lm_head_error(self, seed: int = 0) -> float:
        """max |head(x) - x @ W^T| on random x: > 0 when the packed head no longer matches W."""
        import torch

        head = self._model().lm_head
        w = head.weight  # [V, D]
        g = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randn(4, w.shape[1], generator=g, dtype=torch.float32).to(w.device, w.dtype)  # [4, D]
        with torch.no_grad():
            got = head.quant_method.apply(head, x).float()
            want = torch.nn.functional.linear(x.float(), w.float())
        return float((got - want).abs().max())


class VllmActor:
    """One `vllm.LLM` behind a Ray actor (the pool wraps this class with `ray.remote`).

    Args:
      model_dir: a HF directory to start from, used when `step` is None.
      weights_dir: the trainer's weights checkpoint directory (`weights_io.save_weights`).
      step: start from this checkpoint step instead of `model_dir`.
      dtype: vLLM's weight and activation dtype; HF tensors are cast to it before vLLM sees them.
      max_model_len: longest prompt + response.
      seed: vLLM's engine seed (requests carry their own seeds).
      engine_kwargs: more `vllm.LLM` arguments (max_num_seqs, kv_cache_memory_bytes, ...).
      scratch_dir: where the actor writes HF directories (to start, and for `via_files` loads), each
        removed once vLLM has read it (default: the system temp dir).
      adapter: (PEFT directory, version) to serve on top of the base from the start (LoRA runs; the
        engine needs `enable_lora` in engine_kwargs).
    """

    def __init__(self, model_dir: str | None, weights_dir: str | None, step: int | None, *, dtype: str,
                 max_model_len: int, seed: int = 0, engine_kwargs: dict | None = None,
                 scratch_dir: str | None = None, adapter: tuple[str, int] | None = None):
        import vllm

        self._dtype = dtype
        self._scratch_dir = scratch_dir
        exported = None
        if step is not None:
            exported, _ = self._export(weights_dir, step)
            model_dir = exported
        if model_dir is None:
            raise ValueError("VllmActor needs a HF model_dir or a checkpoint step to start from")
        try:
            self.llm = vllm.LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                skip_tokenizer_init=True, logprobs_mode="raw_logprobs",
                                worker_extension_cls=_EXTENSION, **(engine_kwargs or {}))
        finally:
            if exported is not None:
                shutil.rmtree(exported, ignore_errors=True)
        self._scale = 1.0
        self._lora = None  # the LoRARequest every generate carries (LoRA runs)
        if adapter is not None:
            self.load_adapter(*adapter)

    def ready(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname()}

    # ---- weights -------------------------------------------------------------------------------
    def _export(self, weights_dir: str, step: int) -> tuple[str, dict]:
        """Orbax checkpoint -> a new HF directory in scratch; returns (dir, timings).

        The caller removes the directory once vLLM has read it (the engine keeps the weights in
        memory), so an actor killed between two loads leaves nothing behind.
        """
        from jaxrl_llm.models.hf_io import write_hf_dir
        from jaxrl_llm.weights_io import restore_weights

        t0 = time.perf_counter()
        step, params, cfg = restore_weights(weights_dir, step)
        t1 = time.perf_counter()
        out = tempfile.mkdtemp(prefix=f"jaxrl_vllm_step{step}_", dir=self._scratch_dir)
        try:
            write_hf_dir(params, cfg, out, dtype=_hf_dtype(self._dtype))
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        return out, {"restore_s": t1 - t0, "export_s": time.perf_counter() - t1}

    def load_weights(self, weights_dir: str, step: int, *, via_files: bool = False, repack: bool = True) -> dict:
        """Reloads the engine in place from checkpoint `step`; returns timings in seconds.

        By default every vLLM worker restores the checkpoint and loads the tensors from host memory
        (`VllmWorkerExtension.load_orbax_weights`): "restore_s" and "reload_s" (the slowest worker's,
        plus the repack and cache reset). With `via_files` the actor writes a HF directory and vLLM
        reads it back, as at start: "restore_s", "export_s" (write_hf_dir) and "reload_s".
        """
        if via_files:
            hf_dir, timings = self._export(weights_dir, step)
            t0 = time.perf_counter()
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": hf_dir})
            finally:
                shutil.rmtree(hf_dir, ignore_errors=True)
            timings["reload_s"] = time.perf_counter() - t0
        else:
            per_worker = self.llm.collective_rpc("load_orbax_weights",
                                                 args=(weights_dir, step, _hf_dtype(self._dtype)))
            timings = {k: max(t[k] for t in per_worker) for k in ("restore_s", "reload_s")}
        t0 = time.perf_counter()
        if repack:
            self.llm.collective_rpc("repack_tied_lm_head")
            self.llm.collective_rpc("repack_moe_experts")
        # Cached prefixes hold keys/values computed with the old weights.
        self.llm.reset_prefix_cache()
        timings["reload_s"] += time.perf_counter() - t0
        return timings

    def load_adapter(self, path: str, version: int) -> dict:
        """Serves the PEFT adapter directory `path` (weight `version`) from now on; the previous adapter
        leaves vLLM's cache. Returns {"reload_s": vLLM reading the adapter into its cache}."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        lora_id = int(version) + 1  # vLLM's ids start at 1
        if self._lora is not None and self._lora.lora_int_id != lora_id:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
        # load_inplace: a reused id (a step synced again after a resume) reads the new files, not its cached
        # copy. The generate requests carry a plain one, so they never reload from disk.
        self.llm.llm_engine.add_lora(LoRARequest(f"jaxrl_v{version}", lora_id, path, load_inplace=True))
        request = LoRARequest(f"jaxrl_v{version}", lora_id, path)
        self._lora = request
        self.llm.reset_prefix_cache()  # cached prefixes hold keys/values computed with the old adapter
        return {"reload_s": time.perf_counter() - t0}

    def loaded_adapters(self) -> list[int]:
        """The adapter ids in vLLM's cache (weight version + 1)."""
        return sorted(self.llm.llm_engine.list_loras())

    def lora_modules(self) -> list[str]:
        return self.llm.collective_rpc("lora_modules")[0]

    def lm_head_error(self) -> float:
        return max(self.llm.collective_rpc("lm_head_error"))

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], request: dict) -> list[list[tuple[list[int], list[float], str]]]:
        """Samples `request["n"]` responses per prompt.

        Args:
          prompts: token ids, one list per prompt.
          request: n, temperature, top_p, top_k, max_new_tokens, stop_token_ids, ignore_eos, and
            seeds (one per prompt; response j of a prompt uses seed + j), and optionally max_tokens
            (one per prompt, each <= max_new_tokens).
        Returns:
          per prompt, n (tokens, logprobs, finish_reason); logprobs are log softmax(logits / T) of
          each sampled token (T = 1 when greedy).
        """
        import vllm
        from vllm.inputs import TokensPrompt

        temperature = float(request["temperature"])
        scale = 1.0 / temperature if temperature > 0 else 1.0
        if scale != self._scale:
            self.llm.collective_rpc("set_logit_scale", args=(scale,))
            self._scale = scale
        top_k = int(request["top_k"])
        n = int(request["n"])
        # vLLM refuses n > 1 when greedy; the n greedy responses are one response, repeated.
        n_vllm = n if temperature > 0 else 1
        budgets = request.get("max_tokens") or [request["max_new_tokens"]] * len(prompts)
        params = [vllm.SamplingParams(
            n=n_vllm, temperature=1.0 if temperature > 0 else 0.0, top_p=float(request["top_p"]),
            top_k=top_k if top_k > 0 else -1, max_tokens=int(budget),
            stop_token_ids=list(request["stop_token_ids"]), ignore_eos=bool(request["ignore_eos"]),
            seed=int(seed), logprobs=0, detokenize=False) for seed, budget in zip(request["seeds"], budgets)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                 use_tqdm=False, lora_request=self._lora)
        result = []
        for out in outs:
            responses = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a response with {c.finish_reason!r}")
                toks = list(c.token_ids)
                logps = [float(step[t].logprob) for step, t in zip(c.logprobs, toks)]
                responses.append((toks, logps, c.finish_reason))
            result.append(responses * (n // n_vllm))
        return result
