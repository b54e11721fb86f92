"""The README's first command learns: a shortened gin/grpo_tiny.gin run with a fixed seed lifts the
reward far above chance."""

import numpy as np

from jaxrl_llm.data.arithmetic import build_tokenizer, chance_reward
from tests.trainer import runs


def _demo(gin_file: str, tmp_path, steps: int = 80, *params: str, devices: int = 1
          ) -> tuple[float, list[dict], np.ndarray]:
    """A shortened run of a demo recipe (with gin `params` on top) on `devices` simulated CPU devices: chance
    reward, metric rows, and the per-step mean scores."""
    chance = chance_reward(build_tokenizer(), max_operand=4, max_new_tokens=3)
    out = runs.subprocess.run(
        [runs.sys.executable, "-m", "jaxrl_llm.train", f"--gin_file={gin_file}",
         f"--gin.train.total_training_steps={steps}", f"--gin.train.test_freq={steps}",
         "--gin.train.val_before_train=False", "--gin.train.progress_bar=False", f"--gin.train.run_dir='{tmp_path}'",
         *(f"--gin_param={p}" for p in params)],
        cwd=runs.REPO, capture_output=True, text=True, timeout=600, env=runs.optimised_env(devices=devices))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = runs.metrics(tmp_path)
    scores = np.array([r["critic/score/mean"] for r in rows if "critic/score/mean" in r])
    assert len(scores) == steps and chance < 0.01
    assert scores[:5].mean() < 0.1
    return chance, rows, scores


def test_tiny_grpo_demo_reward_rises_well_above_chance(tmp_path):
    chance, rows, scores = _demo("gin/grpo_tiny.gin", tmp_path)
    assert scores[-10:].mean() > 0.3 > 30 * chance  # the same seed reached ~0.6 by step 75
    assert rows[-1]["val-core/arithmetic/reward/mean@1"] > 0.3


def test_tiny_grpo_lora_demo_passes_its_claim(tmp_path):
    """gin/grpo_tiny_lora.gin: only LoRA adapters train, and the mean reward passes 0.9 in about 110 steps (its
    claim; seeds 0, 1 and 2 averaged 0.93-0.94 over steps 111-120, BENCHMARKS.md). The old recipe (a base drawn at
    initializer_range 0.2) plateaued at 0.88 from step 100 on, and at 0.52-0.68 for other seeds."""
    chance, rows, scores = _demo("gin/grpo_tiny_lora.gin", tmp_path, steps=120)
    assert scores[-10:].mean() > 0.9 > 90 * chance
    assert rows[-1]["val-core/arithmetic/reward/mean@1"] >= 0.9


def test_tiny_qwen35_demo_learns_the_task(tmp_path):
    """gin/grpo_tiny_qwen35.gin: a tiny Qwen3.5 (a linear-attention and a gated-attention layer, generated with
    state slots) learns the task to >= 0.9 (the recipe's seed: 0.94 over steps 171-180, 0.97 by step 200)."""
    chance, rows, scores = _demo("gin/grpo_tiny_qwen35.gin", tmp_path, steps=180)
    assert scores[-10:].mean() > 0.9 > 90 * chance
    assert rows[-1]["val-core/arithmetic/reward/mean@1"] >= 0.9
