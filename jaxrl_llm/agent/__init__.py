"""Agentic RL: multi-turn rollouts with tool calls, token-in-token-out (issue 22).

- `config.MultiTurnConfig`: `rollout.multi_turn.*` (veRL's names).
- `tools`: tools as typed functions or veRL-style `BaseTool` classes, veRL's tool YAML, the runner.
- `formats`: how calls are written (hermes, llama3_json) and parsed.
- `render.TurnRenderer`: ids of the tool turns from the chat template, never re-tokenizing the assistant.
- `loop.AgentLoop`: drives any rollout engine over interleaved multi-turn trajectories.

Submodules are imported on use (the trainer's config imports `config` alone).
"""
