"""Environments in the agent loop: the guess-the-number game driven end to end by the JAX engine with a
random tiny model (every env turn tells the truth about the turn before it, sits under mask 0, and the
same seed gives the same trajectories however slow env steps reorder the engine calls); a scripted
binary search for reward, done and the turn cap; the error paths (raises, hangs, malformed returns: one
counted, logged error that ends only its own row); veRL-style interactions from their YAML; and a
short GRPO run whose rows pick the environment by gin key."""

import logging
import re
import threading
import time
import uuid

import numpy as np
import pytest

from jaxrl_llm.agent import env as envs
from jaxrl_llm.agent.config import MultiTurnConfig
from jaxrl_llm.agent.formats import get_format
from jaxrl_llm.agent.loop import AgentLoop
from jaxrl_llm.agent.tools import ToolRunner
from jaxrl_llm.data import arithmetic
from jaxrl_llm.models import load_hf, split_model
from jaxrl_llm.rollout import JaxEngine, SamplingParams
from tests.agent.scripted import ScriptedEngine
from tests.agent.templates import qwen2_tokenizer
from tests.hf_models import make_hf_model
from tests.trainer import runs

WORDS = {"higher": "+", "lower": "-", "invalid": "="}  # the arithmetic vocabulary has no letters
MAX_LEN = 16


def _rows(tok, secrets, name="guess_number"):
    rows = []
    for i, secret in enumerate(secrets):
        messages = [{"role": "user", "content": "="}]
        ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        rows.append({"prompt_ids": ids, "messages": messages, "index": i, "data_source": "guess_number",
                     "extra_info": {"interaction_kwargs": {"name": name, "secret": secret}}})
    return rows


def _loop(generate, tok, *, runner=None, fmt="hermes", max_len=MAX_LEN, max_prompt=None, **config):
    runner = runner or ToolRunner([], timeout_s=config.pop("timeout_s", 30.0))
    config = MultiTurnConfig(enable=True, env_kwargs=config.pop("env_kwargs", WORDS), **config)
    return AgentLoop(generate, tok, runner, get_format(fmt), config, max_response_length=max_len,
                     max_prompt_length=max_prompt), runner


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    make_hf_model(d, vocab_size=16, eos_token_id=1, initializer_range=0.1, max_position_embeddings=128)
    return load_hf(d)


@envs.register_env("slow_guess", overwrite=True)
class SlowGuess(envs.GuessNumberEnv):
    """The game, with the first step of secret-3 rows held back a while (other rows' turns go first)."""

    def step(self, action):
        if self.secret == 3 and self.guesses == 0:
            time.sleep(0.6)
        return super().step(action)


def test_guess_number_with_the_jax_engine_truthful_env_turns_under_mask_0_and_interleaving_changes_nothing(model):
    tok = arithmetic.build_tokenizer()
    engine = JaxEngine(model.cfg, split_model(model)[1], dtype="float32", page_size=4)
    stops = (1, *tok.convert_tokens_to_ids(["+", "-", "="]))  # short turns; a stop id is not the turn's text
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_LEN, stop_token_ids=stops, seed=3)
    rows = _rows(tok, [3, 6])
    seeds = []

    def generate(*args, **kwargs):
        seeds.append(list(kwargs["seeds"]))
        return engine.generate(*args, **kwargs)

    loop, runner = _loop(generate, tok, max_user_turns=4, max_prompt=8)
    out = loop.run(rows, sampling)
    runner.close()
    assert out.prompt_ids == [rows[0]["prompt_ids"]] * 2 + [rows[1]["prompt_ids"]] * 2
    assert loop.last_metrics["multi_turn/env_errors"] == 0 and out.num_turns.max() >= 3
    for r in range(len(out)):
        secret = [3, 6][out.prompt_index[r]]
        ids, mask = out.tokens[r, : out.lengths[r]], out.loss_mask[r, : out.lengths[r]]
        cuts = np.flatnonzero(np.diff(mask)) + 1
        spans = np.split(np.arange(len(ids)), cuts)
        last = None
        for span in spans:
            if mask[span[0]] == 1:
                turn = ids[span][:-1] if ids[span][-1] in stops else ids[span]
                numbers = re.findall(r"-?\d+", tok.decode(turn, skip_special_tokens=True))
                last = int(numbers[-1]) if numbers else None
            else:  # the env's answer to the turn before it, never sampled
                assert last != secret
                want = "=" if last is None else "+" if secret > last else "-"
                assert tok.decode(ids[span]) == want, (r, last, secret)
                assert np.all(out.logprobs[r, span] == 0)
        env_turns = len(spans) // 2
        assert env_turns <= 4  # max_user_turns caps env turns
        # Done (the secret guessed) is the one way to end on an assistant turn that stopped, under the cap.
        won = out.finish_reasons[r] == "stop" and env_turns < 4
        assert out.env_rewards[r] == float(won) and (not won or last == secret)
    # Slow env steps of the secret-3 rows: other engine calls, the same trajectories.
    seeds_before, seeds[:] = list(seeds), []
    loop, runner = _loop(generate, tok, max_user_turns=4, max_prompt=8, env="slow_guess")
    again = loop.run(_rows(tok, [3, 6], name=None), sampling)
    runner.close()
    assert seeds != seeds_before
    np.testing.assert_array_equal(again.tokens, out.tokens)
    np.testing.assert_array_equal(again.loss_mask, out.loss_mask)
    np.testing.assert_allclose(again.logprobs, out.logprobs, atol=1e-6)
    np.testing.assert_array_equal(again.env_rewards, out.env_rewards)


def _bisect(context: str, seed: int) -> str:
    """Binary search over 0..99 from the user's +/- answers (a scripted player on the Qwen2.5 template)."""
    low, high = 0, 99
    guesses = [int(g) for g in re.findall(r"I guess (\d+)", context)]
    feedback = re.findall(r"<\|im_start\|>user\n([+\-=])<\|im_end\|>", context)[1:]
    for g, f in zip(guesses, feedback):
        low, high = (g + 1, high) if f == "+" else (low, g - 1)
    return f"I guess {(low + high) // 2}"


def test_reward_done_and_the_user_turn_cap_with_a_scripted_player():
    tok = qwen2_tokenizer("qwen2.5")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(tok, _bisect, eos)
    rows = _rows(tok, [49, 75, 12])
    loop, runner = _loop(engine.generate, tok, max_len=400, max_user_turns=8)
    out = loop.run(rows, SamplingParams(n=1, max_new_tokens=400, seed=0))
    # 49 is the first guess; 75 takes 49, 74, 87, 80, 77, 75; 12 takes 49, 24, 11, 17, 14, 12.
    assert out.env_rewards.tolist() == [1.0, 1.0, 1.0] and out.assistant_turns.tolist() == [1, 6, 6]
    assert out.texts[1].split("\n") == [f"I guess {g}" for g in (49, 74, 87, 80, 77, 75)]
    assert out.finish_reasons == ["stop"] * 3
    for r in range(3):  # the response ends with the winning assistant turn (no env message after it)
        assert out.loss_mask[r, out.lengths[r] - 1] == 1 and out.tokens[r, out.lengths[r] - 1] == eos
    # Two env turns at most: the third guess ends the row unanswered (no reward for it).
    loop, runner2 = _loop(engine.generate, tok, max_len=400, max_user_turns=2)
    capped = loop.run(rows, SamplingParams(n=1, max_new_tokens=400, seed=0))
    assert capped.assistant_turns.tolist() == [1, 3, 3] and capped.env_rewards.tolist() == [1.0, 0.0, 0.0]
    assert (capped.num_turns - capped.assistant_turns).tolist() == [0, 2, 2]
    runner.close()
    runner2.close()


class Faulty(envs.GuessNumberEnv):
    """The game, except for the row whose secret names a fault."""

    def reset(self, row):
        self.fault = row["extra_info"]["interaction_kwargs"]["fault"]
        if self.fault == "reset_raises":
            raise RuntimeError("no table free")
        messages = super().reset(row)
        return "not messages" if self.fault == "reset_malformed" else messages

    def step(self, action):
        if self.fault == "step_raises":
            raise KeyError("lost the secret")
        if self.fault == "step_hangs":
            threading.Event().wait(5)
        if self.fault == "bad_reward":
            return [], "one", True, {}
        if self.fault == "bad_role":
            return [{"role": "assistant", "content": "+"}], 0.0, False, {}
        if self.fault == "three_values":
            return [], 0.0, True
        return super().step(action)


FAULTS = ["none", "reset_raises", "reset_malformed", "step_raises", "step_hangs", "bad_reward", "bad_role",
          "three_values"]


def test_an_env_that_raises_hangs_or_returns_garbage_ends_its_own_row_counted_and_logged(caplog):
    envs.register_env("faulty", overwrite=True)(Faulty)
    tok = qwen2_tokenizer("qwen2.5")
    engine = ScriptedEngine(tok, _bisect, tok.convert_tokens_to_ids("<|im_end|>"))
    rows = _rows(tok, [75] * len(FAULTS), name="faulty")
    for row, fault in zip(rows, FAULTS):
        row["extra_info"]["interaction_kwargs"]["fault"] = fault
    loop, runner = _loop(engine.generate, tok, max_len=400, timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm.agent.loop"):
        out = loop.run(rows, SamplingParams(n=1, max_new_tokens=400, seed=0))
    runner.close()
    assert out.env_errors.tolist() == [0] + [1] * (len(FAULTS) - 1)
    assert loop.last_metrics["multi_turn/env_errors"] == len(FAULTS) - 1
    assert out.env_rewards[0] == 1.0 and out.assistant_turns.tolist() == [6, 0, 0, 1, 1, 1, 1, 1]
    assert out.lengths[1] == out.lengths[2] == 0  # a failed reset: no turn at all
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for why in ("reset() raised RuntimeError: no table free", "reset() returned 'not messages'",
                "step() raised KeyError", "step() timed out after 0.5 s", "reward 'one'", "role': one of",
                "it must return (messages, reward, done, info)"):
        assert why in logged, why


class Quiz:
    """A veRL-style interaction (async methods, state by instance id): says 'more' until the answer
    holds the row's expected number, then ends with score 1."""

    def __init__(self, config):
        self.config, self.state, self.finalized = config, {}, []

    async def start_interaction(self, instance_id=None, **kwargs):
        instance_id = instance_id or uuid.uuid4().hex
        self.state[instance_id] = kwargs["expected"]
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        done = str(self.state[instance_id]) in messages[-1]["content"]
        return done, "=" if done else self.config["more"], float(done), {}

    async def calculate_score(self):
        return 0.0

    async def finalize_interaction(self, instance_id):
        self.finalized.append(self.state.pop(instance_id))


def test_verl_interaction_yaml_is_wrapped_as_an_environment(tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text("interaction:\n  - name: quiz\n    class_name: tests.agent.test_env.Quiz\n"
                    "    config: {more: '-'}\n")
    tok = qwen2_tokenizer("qwen2.5")
    engine = ScriptedEngine(tok, lambda ctx, seed: "I guess 3" if ctx.count("-<|im_end|>") >= 2 else "no idea",
                            tok.convert_tokens_to_ids("<|im_end|>"))
    rows = _rows(tok, [0, 0])
    for row, expected in zip(rows, (3, 4)):
        row["extra_info"]["interaction_kwargs"] = {"name": "quiz", "expected": expected}
    loop, runner = _loop(engine.generate, tok, max_len=400, max_user_turns=4, interaction_config_path=str(path))
    out = loop.run(rows, SamplingParams(n=1, max_new_tokens=400, seed=0))
    runner.close()
    assert out.env_rewards.tolist() == [1.0, 0.0] and out.assistant_turns.tolist() == [3, 5]
    quiz = envs.get_env_factory("quiz")({}).interaction  # registered under its YAML name, one shared object
    assert sorted(quiz.finalized) == [3, 4] and quiz.state == {}


def test_unknown_env_names_fail_before_the_first_rollout():
    tok = qwen2_tokenizer("qwen2.5")
    with pytest.raises(envs.EnvError, match="no environment is registered as 'gues_number'"):
        _loop(None, tok, env="gues_number")


def test_a_bad_interaction_yaml_is_one_error_naming_it(tmp_path):
    with pytest.raises(envs.EnvError, match=r"interaction_config_path=.*missing.yaml.*cannot read it"):
        envs.load_interaction_config(str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.yaml").write_text("interaction: [")
    with pytest.raises(envs.EnvError, match=r"bad.yaml: not valid YAML"):
        envs.load_interaction_config(str(tmp_path / "bad.yaml"))
    (tmp_path / "empty.yaml").write_text("interaction: []")
    with pytest.raises(envs.EnvError, match=r"empty.yaml: needs a non-empty list under `interaction:`"):
        envs.load_interaction_config(str(tmp_path / "empty.yaml"))


@envs.register_env("broken_env", overwrite=True)
class _BrokenEnv(envs.Environment):
    def __init__(self, config):
        raise KeyError("target")


def test_an_env_whose_constructor_raises_is_one_error_naming_it():
    selector = envs.EnvSelector(MultiTurnConfig(enable=True, env="broken_env"))
    with pytest.raises(envs.EnvError, match=r"environment 'broken_env' could not be built: its constructor raised "
                                            r"KeyError: 'target'; fix the environment class"):
        selector.make({"prompt_ids": [1]})


def test_grpo_run_with_an_env_by_gin_key(tmp_path):
    """A few GRPO steps whose rows play guess-the-number (`rollout.multi_turn.env`), scored by the env's
    reward."""
    import json

    tok_dir = tmp_path / "tok"
    arithmetic.build_tokenizer(str(tok_dir))
    data = tmp_path / "guess.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"data_source": "guess_number", "prompt": [{"role": "user", "content": "="}],
                                "reward_model": {"ground_truth": str(i % 10)},
                                "extra_info": {"index": i, "interaction_kwargs": {"secret": i % 10}}}) + "\n")
    out = runs.run(tmp_path / "run", "data.source='files'", f"data.train_files=['{data}']",
                   f"model.tokenizer_path='{tok_dir}'", "data.max_response_length=12",
                   "rollout.multi_turn.enable=True", "rollout.multi_turn.env='guess_number'",
                   "rollout.multi_turn.env_kwargs={'higher': '+', 'lower': '-', 'invalid': '='}",
                   "rollout.multi_turn.max_user_turns=3", steps=3)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = runs.metrics(tmp_path / "run")
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert m["multi_turn/env_errors"] == 0 and m["multi_turn/turns_mean"] > 1
        assert m["critic/score/mean"] == pytest.approx(m["multi_turn/env_reward_mean"], abs=1e-6)
