"""The PyTorch side of the benchmarks (section `torch`): transformers peers, and the fp32 parity reference.

Run it as a command of its own before the JAX sections, in the same GPU session (it exits and frees the GPU):
  python -m jaxrl_llm.bench --sections torch --out /tmp/torch_bench [--torch_sections parity,generate,train]
  python -m jaxrl_llm.bench --sections ceilings,parity,rollout --torch_results /tmp/torch_bench --out $OUT

* parity: a random Qwen2.5-1.5B-shaped `Qwen2ForCausalLM`, saved with `save_pretrained`, and its
  fp32 logits (TF32 off) on left-padded GSM8K prompts, for the JAX side's parity section.
* generate: `model.generate` tokens/s at the rollout shapes (sampling, T = 1, EOS off).
* train: fwd + bwd + AdamW steps (bf16 autocast, gradient checkpointing), as in PEERS.md.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from jaxrl_llm.bench.harness import emit, option, section
from jaxrl_llm.bench.workload import gsm8k_prompts, hf_config_dict

option("--torch_sections", default="parity,generate,train", help="torch: which of parity, generate, train")

DEVICE = "cuda"


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ceilings() -> list[dict]:
    """The hardware ceilings as the vendor library reaches them: a device copy and a bf16 matmul."""
    import torch

    x = torch.randn(1 << 29, device=DEVICE)  # 2 GiB
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    out = []
    for what, fn, work in (("hw_copy", lambda: x.clone(), 2 * x.numel() * 4),
                           ("hw_bf16_matmul", lambda: a @ b, 2 * 8192 ** 3)):
        t_end = time.perf_counter() + 1.0
        while time.perf_counter() < t_end:  # warm the clocks up
            fn()
        _sync()
        t0 = time.perf_counter()
        for _ in range(30):
            fn()
        _sync()
        dt = (time.perf_counter() - t0) / 30
        key = "tb_s" if what == "hw_copy" else "tflops"
        out.append({"section": "ceilings", "what": what, "framework": "torch", key: work / dt / 1e12})
    return out


def parity(out_dir: str, preset: str, n_prompts: int) -> dict:
    import torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = transformers.Qwen2Config(**hf_config_dict(preset))
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF zero-initialises biases; random ones make the check cover them
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    model_dir = os.path.join(out_dir, f"hf_{preset}")
    model.save_pretrained(model_dir, safe_serialization=True)
    prompts = gsm8k_prompts(n_prompts)
    t = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), t), np.int64)
    mask = np.zeros((len(prompts), t), np.int64)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):], mask[i, t - len(p):] = p, 1
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids, device=DEVICE), attention_mask=torch.tensor(mask, device=DEVICE),
                       position_ids=torch.tensor(pos, device=DEVICE)).logits.float().cpu().numpy()
    np.savez(os.path.join(out_dir, "parity_ref.npz"), ids=ids, mask=mask, logits=logits)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return {"section": "parity_ref", "preset": preset, "model_dir": model_dir, "prompts": len(prompts), "t": t}


def generate(preset: str, batch: int, new_tokens: int) -> dict:
    import torch
    import transformers

    cfg = transformers.Qwen2Config(**hf_config_dict(preset))
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    prompts = gsm8k_prompts(batch)
    t = max(len(p) for p in prompts)
    ids = torch.zeros((batch, t), dtype=torch.long)
    mask = torch.zeros((batch, t), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):], mask[i, t - len(p):] = torch.tensor(p), 1
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
              top_k=0, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(input_ids=ids[:, :t], attention_mask=mask, max_new_tokens=4, do_sample=True, top_k=0,
                       pad_token_id=0)
        _sync()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        _sync()
        dt = time.perf_counter() - t0
    assert out.shape[1] - t == new_tokens
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return {"section": "peer_generate", "framework": "transformers", "preset": preset, "batch": batch,
            "new_tokens": new_tokens, "seconds": dt, "tokens_per_s": batch * new_tokens / dt}


def train(preset: str, batch: int, seq: int, steps: int = 6) -> dict:
    import torch
    import transformers

    cfg = transformers.Qwen2Config(**hf_config_dict(preset))
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.Qwen2ForCausalLM(cfg).float()
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=DEVICE, generator=gen)
    times = []
    for i in range(steps):
        _sync()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    dt = float(np.median(times))
    peak = torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else float("nan")
    del model, opt
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return {"section": "peer_train", "framework": "transformers", "preset": preset, "batch": batch, "seq": seq,
            "seconds": dt, "tokens_per_s": batch * seq / dt, "peak_gb": peak}


@section("torch", help="transformers peers (generate, train) and the fp32 parity reference, in torch; a command "
         "of its own", defaults={}, uses_jax=False)
def torch_section(args) -> None:
    global DEVICE
    import torch

    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    big = not args.small
    sections = args.torch_sections.split(",")
    results = []

    def run(fn, *a):
        try:
            rows = fn(*a)
            for r in rows if isinstance(rows, list) else [rows]:
                emit(**r)
                results.append(r)
        except Exception as e:  # keep the other measurements
            print(f"FAILED {fn.__name__}{a}: {type(e).__name__}: {e}", flush=True)
            results.append(emit(section=fn.__name__, args=list(map(str, a)), error=f"{type(e).__name__}: {e}"))

    if big:
        run(ceilings)
    if "parity" in sections:
        run(parity, args.out, "qwen2p5_1p5b" if big else "tiny", 8)
    if "generate" in sections:
        shapes = (("qwen2p5_0p5b", 64), ("qwen2p5_0p5b", 256), ("qwen2p5_1p5b", 256)) if big else (("tiny", 4),)
        for preset, batch in shapes:
            run(generate, preset, batch, 232 if big else 8)
    if "train" in sections:
        for preset, b, s in ((("qwen2p5_0p5b", 32, 512), ("qwen2p5_1p5b", 16, 512)) if big else (("tiny", 4, 64),)):
            run(train, preset, b, s)
    with open(os.path.join(args.out, "torch_results.json"), "w") as f:  # what --torch_results reads
        json.dump(results, f, indent=1)
