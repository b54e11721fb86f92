"""The agent loop: multi-turn rollouts with tool calls, token-in-token-out, over any rollout engine.

Each of the R = prompts x n trajectories alternates assistant turns (sampled by the engine) and tool
turns (the calls parsed from the assistant's text, run by a `ToolSession`). The response of a
trajectory is one id sequence: the assistant turns exactly as sampled (loss mask 1, with the sampler's
log-probs) and, between them, the ids of the tool turns and of the template's glue (mask 0), rendered
by `TurnRenderer` from the chat template. Nothing is decoded and re-tokenized.

Turns interleave: every engine call takes each trajectory that is ready, while the tools of the others
still run on the runner's threads; a slow tool holds back only its own trajectory. The interleaving
cannot change a trajectory: turn k of trajectory r draws from its own random stream (the engines'
`seeds`: fold_in(fold_in(key(seed), stream(r, k)), t)), whatever else shares the engine call.

Environments (`jaxrl_llm.agent.env`): a row with one starts from `env.reset(row)`'s messages (rendered into
its prompt), and each assistant turn goes to `env.step` instead of the tools; the step's messages are
appended under mask 0 like a tool turn, its reward adds to the row's, and `done` ends the row. An env that
raises, hangs past the tool timeout or returns a malformed value ends its row (finish 'stop'), counted in
`multi_turn/env_errors` and logged; the run goes on.

Caps: `max_assistant_turns`, `max_user_turns` (each tool or env turn counts), and `max_response_length`, which
counts every response token: each turn may sample at most the remaining budget, and a tool turn that
would not leave room for one more token ends the trajectory before it is appended (finish 'length').
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl_llm.agent import env as envs
from jaxrl_llm.agent.config import MultiTurnConfig
from jaxrl_llm.agent.render import RenderError, TurnRenderer, render_prompt
from jaxrl_llm.rollout.base import RolloutBatch, SamplingParams

log = logging.getLogger(__name__)

AGENTS = ("tool_agent", "single_turn_agent")  # veRL's agent_name values
_TURN_BITS = 24  # stream(r, k) = k << 24 | r: turn 0 of row r draws like a single-turn rollout's row r
# Seconds the loop waits for the other running tools after the first one finishes, so that the next
# engine call takes them too (each call has a fixed cost); a slower tool runs on, and its row joins a
# later call.
_GATHER_S = 0.25


class AgentLoopError(ValueError):
    """Agent-loop input the loop cannot run (an unknown agent_name, too many rows or turns)."""


@dataclasses.dataclass
class AgentBatch(RolloutBatch):
    """A `RolloutBatch` whose responses hold tool turns: `loss_mask` [R, T] is 1 on sampled assistant
    tokens only, and the per-response agent statistics ([R] each) come along."""

    loss_mask: np.ndarray | None = None  # [R, T] float32
    num_turns: np.ndarray | None = None  # [R] assistant + tool turns (veRL's num_turns counts both)
    assistant_turns: np.ndarray | None = None  # [R]
    tool_calls: np.ndarray | None = None  # [R]
    tool_errors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # kind -> [R]
    tool_seconds: np.ndarray | None = None  # [R]
    tool_rewards: np.ndarray | None = None  # [R] step rewards + calc_reward
    texts: list[str] = dataclasses.field(default_factory=list)  # [R] assistant text only
    env_rewards: np.ndarray | None = None  # [R] the environment's summed step rewards (0 without one)
    env_errors: np.ndarray | None = None  # [R] 1 where the environment failed
    prompt_ids: list[list[int]] | None = None  # [R] each trajectory's prompt when an environment set it


@dataclasses.dataclass(eq=False)
class _Trajectory:
    row: int
    prompt: list[int]
    messages: list[dict]
    session: object
    single_turn: bool
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    step_reward: float = 0.0
    pending: list | str = dataclasses.field(default_factory=list)  # the calls (or env action) of the last turn
    finish: str | None = None
    env: envs.Environment | None = None
    env_reward: float = 0.0
    env_error: str | None = None


class AgentLoop:
    """Runs multi-turn rollouts.

    Args:
      generate: an engine's `generate(prompts, sampling, max_new_tokens_per_row=, seeds=)`.
      tokenizer: the run's HF tokenizer (its chat template renders tool turns).
      runner: the `ToolRunner` with the run's tools.
      tool_format: the `ToolFormat` that parses calls from an assistant's text.
      config: `rollout.multi_turn.*`.
      max_response_length: response tokens at most (assistant + tool), `data.max_response_length`.
      max_prompt_length: the longest prompt an environment's `reset` may give (`data.max_prompt_length`).
    """

    def __init__(self, generate: Callable[..., RolloutBatch], tokenizer, runner, tool_format,
                 config: MultiTurnConfig, *, max_response_length: int, max_prompt_length: int | None = None):
        self.generate = generate
        self.tokenizer = tokenizer
        self.runner = runner
        self.format = tool_format
        self.config = config
        self.max_response_length = max_response_length
        self.max_prompt_length = max_prompt_length
        self.envs = envs.EnvSelector(config)
        self.renderer = TurnRenderer(tokenizer, runner.schemas)
        self.last_metrics: dict[str, float] = {}

    # ---- one rollout -----------------------------------------------------------------------------
    def run(self, rows: Sequence[dict], sampling: SamplingParams) -> AgentBatch:
        """`sampling.n` trajectories for every row (prompt-major: trajectory j of row i is i * n + j).

        A row is a dataset item: `prompt_ids` (the prompt rendered with the tool schemas), `messages`
        (the prompt's messages, for rendering later turns), optional `agent_name` and
        `extra_info.tools_kwargs` (veRL's per-row tool arguments).
        """
        n = sampling.n
        if len(rows) * n >= 1 << _TURN_BITS:
            raise AgentLoopError(f"{len(rows) * n} trajectories in one rollout; the agent loop seeds at most "
                                 f"{(1 << _TURN_BITS) - 1} (lower data.train_batch_size or rollout.n)")
        trajs: list[_Trajectory] = []
        try:
            for r in range(len(rows) * n):
                trajs.append(self._start(r, rows[r // n]))
            self._reset_envs([t for t in trajs if t.env is not None], rows, n)
            self._drive(trajs, sampling)
            for t in trajs:
                t.step_reward += float(t.session.reward())
        finally:
            for t in trajs:
                t.session.release()
                if t.env is not None:
                    try:
                        t.env.close()
                    except Exception as e:  # noqa: BLE001 (an env's fault must not end the run)
                        log.warning("row %d: env close() raised %s: %s", t.row, type(e).__name__, e)
        return self._result(trajs, len(rows), n)

    def _start(self, r: int, row: dict) -> _Trajectory:
        agent = row.get("agent_name") or "tool_agent"
        if agent not in AGENTS and agent not in envs.registered_envs():
            raise AgentLoopError(f"row {row.get('index', r)}: agent_name {agent!r} is not one of {AGENTS} nor a "
                                 f"registered environment {envs.registered_envs()}; fix the dataset's agent_name "
                                 "column (or register the environment)")
        extra = row.get("extra_info") or {}
        messages = row.get("messages")
        if messages is None:
            raise AgentLoopError(f"row {row.get('index', r)} has no 'messages'; multi-turn rollouts render later "
                                 "turns from the prompt's messages (a dataset read with data.prompt_key has them)")
        single = agent == "single_turn_agent"
        return _Trajectory(row=r, prompt=list(map(int, row["prompt_ids"])), messages=[dict(m) for m in messages],
                           session=self.runner.open(extra.get("tools_kwargs")), single_turn=single,
                           env=None if single else self.envs.make(row))

    def _reset_envs(self, trajs: list[_Trajectory], rows: Sequence[dict], n: int) -> None:
        """`reset` of every environment at once (on the runner's threads, under the tool timeout); the
        messages become the trajectory's conversation and prompt. A failed reset ends the trajectory
        before its first turn (an empty response)."""
        futures = [self.runner.submit(envs.call_env(self.runner, t.env.reset, rows[t.row // n])) for t in trajs]
        for t, f in zip(trajs, futures):
            messages, error = f.result()
            error = error and f"reset() {error}"
            if error is None:
                try:
                    messages = envs.check_messages(messages, "reset()", roles=("system", "user", "assistant", "tool"))
                    prompt = render_prompt(self.tokenizer, messages, self.runner.schemas)
                    if self.max_prompt_length and len(prompt) > self.max_prompt_length:
                        raise ValueError(f"reset() gave a prompt of {len(prompt)} tokens, more than "
                                         f"data.max_prompt_length={self.max_prompt_length}")
                    t.messages, t.prompt = messages, prompt
                except Exception as e:  # noqa: BLE001 (the template's or the env's fault: a counted error)
                    error = str(e)
            if error is not None:
                self._env_failed(t, error)

    def _drive(self, trajs: list[_Trajectory], sampling: SamplingParams) -> None:
        """Engine calls on every ready trajectory, tools on the runner, until every trajectory is done."""
        ready = [t for t in trajs if t.finish is None]
        running: dict[concurrent.futures.Future, _Trajectory] = {}
        self._engine_calls = 0
        while ready or running:
            if ready:
                self._engine_calls += 1
                self._assistant_turn(ready, sampling)
                running.update({self._act(t): t for t in ready if t.finish is None})
                ready = []
            if running:
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                more, _ = concurrent.futures.wait(running, timeout=_GATHER_S)
                for f in sorted(done | more, key=lambda f: running[f].row):
                    t = running.pop(f)
                    if t.env is not None:
                        self._env_turn(t, *f.result())
                    else:
                        self._tool_turn(t, f.result())  # the session never raises for a tool's fault
                    if t.finish is None:
                        ready.append(t)

    def _assistant_turn(self, ready: list[_Trajectory], sampling: SamplingParams) -> None:
        budgets = [self.max_response_length - len(t.ids) for t in ready]
        seeds = [(t.assistant_turns << _TURN_BITS) | t.row for t in ready]
        # max_new_tokens stays the whole budget (the engines' programs are shaped by it); rows get their own.
        out = self.generate([t.prompt + t.ids for t in ready],
                            sampling.replace(n=1, max_new_tokens=self.max_response_length),
                            max_new_tokens_per_row=budgets, seeds=seeds)
        for i, t in enumerate(ready):
            ids = out.tokens[i, : out.lengths[i]].tolist()
            t.ids += ids
            t.mask += [1] * len(ids)
            t.logps += out.logprobs[i, : len(ids)].tolist()
            t.assistant_turns += 1
            stopped = out.finish_reasons[i] == "stop"
            body = ids[:-1] if stopped else ids
            content = self.tokenizer.decode(body, skip_special_tokens=False)
            t.texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
            t.messages.append({"role": "assistant", "content": content})
            c = self.config
            if not stopped:
                t.finish = "length"
            elif t.single_turn or (c.max_assistant_turns and t.assistant_turns >= c.max_assistant_turns) or (
                    c.max_user_turns and t.user_turns >= c.max_user_turns):
                t.finish = "stop"
            else:
                t.pending = self.format.parse(content)
                if t.env is not None:  # the env answers every turn: the calls if any (and it wants them)
                    t.pending = t.pending if t.pending and t.env.parse_calls else content
                elif not t.pending:
                    t.finish = "stop"

    def _act(self, t: _Trajectory) -> concurrent.futures.Future:
        """The future of `t`'s last turn's consequence: its env's step, or its tool calls."""
        if t.env is not None:
            return self.runner.submit(envs.call_env(self.runner, t.env.step, t.pending))
        return t.session.call_future(t.pending)

    def _env_failed(self, t: _Trajectory, reason: str) -> None:
        t.env_error, t.finish = reason, "stop"
        log.warning("row %d: environment %s failed, the trajectory ends: %s", t.row, type(t.env).__name__, reason)

    def _env_turn(self, t: _Trajectory, out, error: str | None) -> None:
        """Appends the env's messages after `t`'s turn, adds its reward; ends `t` when done (the messages of
        the last step are not appended: a response ends with the assistant's turn) or when it failed."""
        error = error and f"step() {error}"
        if error is None:
            try:
                new, reward, done, _ = envs.check_step(out)
            except ValueError as e:
                error = str(e)
        if error is not None:
            self._env_failed(t, error)
            return
        t.env_reward += reward
        if done:
            t.finish = "stop"
            return
        try:
            self._append_turn(t, new)
        except RenderError as e:
            self._env_failed(t, f"step() gave messages the chat template cannot append: {e}")

    def _tool_turn(self, t: _Trajectory, results) -> None:
        """Appends the tool turn of `t`'s calls, or ends `t` when it would not fit."""
        t.step_reward += sum(float(res.reward) for res in results)
        self._append_turn(t, [{"role": "tool", "content": res.text} for res in results])

    def _append_turn(self, t: _Trajectory, new: list[dict]) -> None:
        """Appends the mask-0 ids of the messages that answer `t`'s turn, or ends `t` when they would not fit."""
        ids = self.renderer.turn_ids(t.messages, new, t.ids[-1])
        if len(t.ids) + len(ids) + 1 > self.max_response_length:
            t.finish = "length"  # the tool output would leave no room for an answer: end before it
            return
        t.messages += new
        t.ids += ids
        t.mask += [0] * len(ids)
        t.logps += [0.0] * len(ids)
        t.user_turns += 1

    # ---- results ---------------------------------------------------------------------------------
    def _result(self, trajs: list[_Trajectory], num_prompts: int, n: int) -> AgentBatch:
        r = len(trajs)
        width = max(1, *(len(t.ids) for t in trajs))
        pad = self.tokenizer.pad_token_id or 0
        tokens = np.full((r, width), pad, np.int32)  # [R, T]
        logps = np.zeros((r, width), np.float32)  # [R, T]
        mask = np.zeros((r, width), np.float32)  # [R, T]
        for i, t in enumerate(trajs):
            tokens[i, : len(t.ids)] = t.ids
            logps[i, : len(t.ids)] = t.logps
            mask[i, : len(t.ids)] = t.mask
        stat = lambda key: np.asarray([t.session.metrics.get(key, 0.0) for t in trajs], np.float32)
        kinds = sorted({k for t in trajs for k in t.session.metrics if k.startswith("errors/")})
        out = AgentBatch(prompt_index=np.repeat(np.arange(num_prompts), n), tokens=tokens, logprobs=logps,
                         lengths=np.asarray([len(t.ids) for t in trajs], np.int32),
                         finish_reasons=[t.finish for t in trajs], loss_mask=mask,
                         num_turns=np.asarray([t.assistant_turns + t.user_turns for t in trajs], np.int32),
                         assistant_turns=np.asarray([t.assistant_turns for t in trajs], np.int32),
                         tool_calls=stat("calls"), tool_errors={k[len("errors/"):]: stat(k) for k in kinds},
                         tool_seconds=stat("seconds"),
                         tool_rewards=np.asarray([t.step_reward for t in trajs], np.float32),
                         texts=["\n".join(t.texts) for t in trajs],
                         env_rewards=np.asarray([t.env_reward for t in trajs], np.float32),
                         env_errors=np.asarray([t.env_error is not None for t in trajs], np.float32))
        if any(t.env is not None for t in trajs):
            out.prompt_ids = [t.prompt for t in trajs]
        self.last_metrics = {**agent_metrics(out), "multi_turn/engine_calls": float(self._engine_calls)}
        return out


def agent_metrics(batch: AgentBatch) -> dict[str, float]:
    """veRL-style `multi_turn/*` metrics of one rollout."""
    out = {"multi_turn/turns_mean": float(np.mean(batch.num_turns)),
           "multi_turn/turns_max": float(np.max(batch.num_turns)),
           "multi_turn/turns_min": float(np.min(batch.num_turns)),
           "multi_turn/assistant_turns_mean": float(np.mean(batch.assistant_turns)),
           "multi_turn/tool_calls_mean": float(np.mean(batch.tool_calls)),
           "multi_turn/tool_calls_total": float(np.sum(batch.tool_calls)),
           "multi_turn/tool_errors": float(sum(np.sum(v) for k, v in batch.tool_errors.items() if k != "reward")),
           "multi_turn/tool_seconds": float(np.sum(batch.tool_seconds)),
           "multi_turn/tool_seconds_mean": float(np.mean(batch.tool_seconds)),
           "multi_turn/tool_reward_mean": float(np.mean(batch.tool_rewards)),
           "multi_turn/length_ratio": float(np.mean([f == "length" for f in batch.finish_reasons])),
           "multi_turn/tool_token_ratio": float(1.0 - batch.loss_mask.sum() / max(int(batch.lengths.sum()), 1))}
    if batch.prompt_ids is not None:  # a rollout with environments
        out["multi_turn/env_reward_mean"] = float(np.mean(batch.env_rewards))
        out["multi_turn/env_errors"] = float(np.sum(batch.env_errors))
    for kind, counts in batch.tool_errors.items():
        out[f"multi_turn/tool_errors/{kind}"] = float(np.sum(counts))
    return out
