"""The benchmarks' workload: GSM8K prompts, the seed run's response lengths, and the run config and synthetic
batch the training sections share.

Prompts are real GSM8K test questions with veRL's instruction, through the Qwen2 chat template
(94 tokens on average). Data comes from `.bench_data/` in the repo (carried to the GPU machine, built by
scripts/make_bench_data.py) or `../shared/data/`.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from jaxrl_llm.bench.harness import ATTENTION, REPO

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# The seed run's responses: 232 tokens on average, at most 1024. We draw lognormal lengths with that
# mean (sigma 0.5), clipped to [16, 1024].
SEED_RESPONSE_MEAN = 232
SEED_RESPONSE_MAX = 1024


def data_dir() -> str:
    """The benchmarks' tokenizer and prompts: .bench_data/ (carried to a lent GPU), else JAXRL_SHARED_DATA (the
    tests' setting), else ../shared/data/."""
    shared = os.environ.get("JAXRL_SHARED_DATA", os.path.join(REPO, "..", "shared", "data"))
    for d in (os.path.join(REPO, ".bench_data"), shared):
        if os.path.isdir(os.path.join(d, "qwen2_tokenizer")):
            return d
    raise FileNotFoundError(f"no .bench_data/ or {shared} with qwen2_tokenizer; set JAXRL_SHARED_DATA")


@functools.cache
def tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(os.path.join(data_dir(), "qwen2_tokenizer"))


@functools.cache
def gsm8k_test_file() -> str:
    """GSM8K's test split as veRL-schema jsonl, what the training sections read: `.bench_data/`'s, or one written
    once a process from `../shared/data/gsm8k/test.jsonl` (a fresh clone has no `.bench_data/`)."""
    d = data_dir()
    path = os.path.join(d, "gsm8k_test.jsonl")
    if os.path.exists(path):
        return path
    import tempfile

    from jaxrl_llm.data.gsm8k import load_gsm8k_rows

    path = os.path.join(tempfile.mkdtemp(prefix="bench_gsm8k_"), "gsm8k_test.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in load_gsm8k_rows("test", os.path.join(d, "gsm8k")))
    return path


@functools.cache
def _questions() -> tuple[str, ...]:
    d = data_dir()
    path = os.path.join(d, "gsm8k_test.jsonl")
    if os.path.exists(path):  # veRL-schema rows
        with open(path) as f:
            return tuple(json.loads(line)["prompt"][0]["content"] for line in f)
    with open(os.path.join(d, "gsm8k", "test.jsonl")) as f:
        return tuple(json.loads(line)["question"] + " " + INSTRUCTION for line in f)


def gsm8k_prompts(n: int, vocab_size: int | None = None) -> list[list[int]]:
    """n prompt token-id lists (cycling through the 1,319 test questions), in the Qwen2 vocabulary.

    With `vocab_size` (a model of a smaller vocabulary, e.g. Llama 3's 128,256), ids past it are folded into
    it (id % vocab_size): random weights care about the shape of the work, not which ids it reads."""
    tok = tokenizer()
    qs = _questions()
    out = []
    for i in range(n):
        text = tok.apply_chat_template([{"role": "user", "content": qs[i % len(qs)]}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out.append([i % vocab_size for i in ids] if vocab_size else ids)
    return out


@functools.cache
def gsm8k_prompt_lengths() -> np.ndarray:
    """[1319] token counts of `gsm8k_prompts`' prompts, by the same chat template and tokenizer read without
    transformers (whose import alone takes seconds): what a test of the seed's lengths needs."""
    import jinja2
    import tokenizers

    d = os.path.join(data_dir(), "qwen2_tokenizer")
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(json.load(f)["chat_template"])
    texts = [template.render(messages=[{"role": "user", "content": q}], add_generation_prompt=True)
             for q in _questions()]
    tok = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    return np.asarray([len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)], np.int32)


def seed_response_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mu = np.log(SEED_RESPONSE_MEAN) - 0.5 ** 2 / 2
    return np.clip(np.round(rng.lognormal(mu, 0.5, size=n)), 16, SEED_RESPONSE_MAX).astype(np.int32)


def hf_config_dict(preset: str) -> dict:
    from jaxrl_llm.models.config import PRESETS

    extra = {"vocab_size": 151936, "head_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 1} \
        if preset == "tiny" else {}
    cfg = PRESETS[preset](**extra).to_hf()
    cfg.pop("architectures", None)
    cfg.pop("model_type", None)
    return cfg


def dir_bytes(path: str) -> int:
    """Bytes of every file under `path`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def long_lengths(n: int, seed: int = 0, cap: int = 16384) -> np.ndarray:
    """A heavy tail: most responses a few hundred tokens, a few past 8k, one at the cap."""
    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(rng.pareto(1.1, size=n) * 300 + 64), 64, cap).astype(np.int32)
    lens[0] = cap
    return lens


def make_run(preset: str, *, prompts: int, n: int, mini: int, budget: int, remat: str, fsdp: int = -1, tensor: int = 1,
             max_response: int = 1024, max_prompt: int = 512, small: bool = False, run_dir: str = "/tmp/bench_run",
             max_batch: int = 4096, decode_attention: str = "auto", kv_cache: str = "paged", lora_rank: int = 0,
             lora_alpha: float = 64.0, base_quantization: str = "none", total_steps: int = 3, tail_shapes: int = 4,
             fuse_log_prob_passes: bool = True, compile_ahead: bool | None = None, ignore_eos: bool = False):
    from jaxrl_llm.models.config import PRESETS
    from jaxrl_llm.trainer import config as C

    d = data_dir()
    return C.RunConfig(
        model=C.ModelConfig(preset=preset, tokenizer_path=os.path.join(d, "qwen2_tokenizer"),
                            dtype="float32" if small else "bfloat16", param_dtype="float32", remat=remat,
                            attention_impl=ATTENTION["impl"],
                            # Qwen2 token ids: a model of a smaller vocabulary (Llama 3) gets Qwen2's, so the
                            # real prompts stay in range (+2-4% parameters at Llama's shapes)
                            overrides={"vocab_size": 151936} if small or PRESETS[preset]().vocab_size < 151936
                            else None,
                            # LoRA on every linear layer (rank 0: full fine-tuning), at 10x the learning rate
                            lora_rank=lora_rank, lora_alpha=lora_alpha, base_quantization=base_quantization),
        data=C.DataConfig(source="files", train_files=(gsm8k_test_file(),),
                          train_batch_size=prompts, max_prompt_length=max_prompt, max_response_length=max_response),
        rollout=C.RolloutConfig(n=n, temperature=1.0, max_batch_size=max_batch, decode_attention=decode_attention,
                                kv_cache=kv_cache, fuse_log_prob_passes=fuse_log_prob_passes, ignore_eos=ignore_eos),
        actor=C.ActorConfig(lr=1e-5 if lora_rank else 1e-6, ppo_mini_batch_size=mini,
                            ppo_max_token_len_per_gpu=budget, use_kl_loss=True,
                            kl_loss_coef=0.001, kl_loss_type="low_var_kl", tail_shapes=tail_shapes),
        critic=C.CriticConfig(), algo=C.AlgoConfig(adv_estimator="grpo"), reward=C.RewardConfig(),
        trainer=C.TrainerConfig(run_dir=run_dir, logger=("jsonl",), driver="inprocess", mesh_fsdp=fsdp,
                                mesh_tensor=tensor,
                                progress_bar=False, total_training_steps=total_steps,
                                compile_ahead=compile_ahead)).validate()


def synthetic_batch(n_prompts: int, n: int, max_response: int, vocab: int, seed: int = 0, max_prompt: int = 512):
    """GSM8K prompts with random responses of the seed's lengths and random advantages."""
    from jaxrl_llm.trainer.batch import TrainBatch

    prompts = [p[-max_prompt:] for p in gsm8k_prompts(n_prompts)]
    r = n_prompts * n
    lens = np.minimum(seed_response_lengths(r, seed), max_response)
    rng = np.random.default_rng(seed)
    responses = rng.integers(0, min(vocab, 150000), size=(r, max_response)).astype(np.int32)
    mask = (np.arange(max_response)[None] < lens[:, None]).astype(np.float32)
    prompt_ids = [np.asarray(prompts[i // n], np.int32) for i in range(r)]
    b = TrainBatch(prompt_ids=prompt_ids, responses=responses * mask.astype(np.int32), response_mask=mask,
                   group_ids=np.repeat(np.arange(n_prompts), n).astype(np.int32))
    b.fields["advantages"] = (rng.standard_normal((r, 1)) * mask).astype(np.float32)
    return b
