"""Every run-config key with its default and one line of doc, and hints for a binding that names no key.

The keys are the fields of the gin-configurable dataclasses that `build_run_config` builds (`actor.lr`,
`train.save_freq`, ..., and the nested `rollout.multi_turn.*`). Their docs are read from the source, so
the code stays the one place they are written: a field's comment (the lines right above it and the one
after it on its line), or its entry in the class docstring (`name: text`, or `a / b: text` for several).
`python -m jaxrl_llm.train --list_keys [FILTER]` prints them as gin lines.

`hint(key)` turns an unknown key into advice: veRL's spellings (`trainer.total_epochs`,
`actor_rollout_ref.actor.optim.lr`) map to ours (`train.total_epochs`, `actor.lr`), and a typo gets the
nearest keys (`actor.lrr` -> `actor.lr`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import re
import textwrap
import tokenize
from typing import NamedTuple


class Key(NamedTuple):
    name: str  # the gin binding, e.g. "actor.lr"
    default: object
    doc: str


# veRL's config paths whose leaf names are ours under another section, longest prefix first.
VERL_PREFIXES = (
    ("actor_rollout_ref.rollout.val_kwargs.", "rollout.val_"),
    ("actor_rollout_ref.actor.optim.", "actor."),
    ("actor_rollout_ref.actor.", "actor."),
    ("actor_rollout_ref.rollout.", "rollout."),
    ("actor_rollout_ref.model.", "model."),
    ("actor_rollout_ref.ref.", "actor."),
    ("critic.optim.", "critic."),
    ("algorithm.kl_ctrl.", "algorithm.kl_"),
    ("custom_reward_function.", "reward.custom_reward_"),
    ("trainer.", "train."),
)
# veRL keys whose leaf is named differently here.
VERL_KEYS = {
    "actor_rollout_ref.actor.optim.clip_grad": "actor.grad_clip",
    "actor_rollout_ref.actor.grad_clip": "actor.grad_clip",
    "actor_rollout_ref.actor.optim.warmup_style": "actor.lr_scheduler",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor.lr_scheduler",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.actor.ppo_micro_batch_size": "actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.name": "rollout.engine",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "rollout.log_prob_max_token_len_per_gpu",
    "algorithm.kl_ctrl.type": "algorithm.kl_ctrl_type",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl_target",
    "algorithm.kl_ctrl.horizon": "algorithm.kl_horizon",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "custom_reward_function.path": "reward.custom_reward_path",
    "custom_reward_function.name": "reward.custom_reward_name",
    "trainer.default_local_dir": "train.run_dir",
    "critic.model.path": "model.critic_path",
}


@functools.cache
def all_keys() -> tuple[Key, ...]:
    """Every key of the run config, section by section in `build_run_config`'s order."""
    from jaxrl_llm.trainer.config.run import PARTS

    out: list[Key] = []
    for _, section, cls in PARTS:
        out.extend(_section_keys(section, cls))
    return tuple(out)


def _section_keys(section: str, cls) -> list[Key]:
    docs = field_docs(cls)
    keys, nested = [], []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):  # its own section (rollout.multi_turn.*), after this one's keys
            nested.extend(_section_keys(f"{section}.{f.name}", type(default)))
        else:
            keys.append(Key(f"{section}.{f.name}", default, docs.get(f.name, "")))
    return keys + nested


def field_docs(cls) -> dict[str, str]:
    """{field name: its doc on one line}: the class docstring's entries, else the field's comments."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type == tokenize.COMMENT}
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef))
    docs = _docstring_entries(ast.get_docstring(node) or "")
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        if name in docs:
            continue
        above, row = [], stmt.lineno - 1
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        trailing = comments.get(stmt.end_lineno) if not lines[stmt.end_lineno - 1].strip().startswith("#") else None
        docs[name] = " ".join(part for part in (*above, trailing) if part)
    return docs


def _docstring_entries(doc: str) -> dict[str, str]:
    """`name: text` / `a / b: text` entries of a docstring (continuation lines indented deeper)."""
    out: dict[str, str] = {}
    names: list[str] = []
    indent = None
    for line in doc.splitlines():
        m = re.match(r"^(\s*)([a-z_][a-z0-9_]*(?:\s*/\s*[a-z_][a-z0-9_]*)*):\s+(\S.*)$", line)
        if m and (indent is None or len(m.group(1)) <= indent):
            indent = len(m.group(1))
            names = [n.strip() for n in m.group(2).split("/")]
            for n in names:
                out[n] = m.group(3).strip()
        elif names and line.strip() and indent is not None and len(line) - len(line.lstrip()) > indent:
            for n in names:
                out[n] += " " + line.strip()
        else:
            names = []
    return out


def format_keys(pattern: str | None = None) -> str:
    """The keys (those containing `pattern`, if given) as gin lines: `key = default  # doc`."""
    out, section = [], None
    for key in all_keys():
        if pattern and pattern not in key.name:
            continue
        sec = key.name.rsplit(".", 1)[0]
        if sec != section:
            out.append(f"{'' if section is None else chr(10)}# {sec}.*")
            section = sec
        out.append(f"{key.name} = {key.default!r}" + (f"  # {key.doc}" if key.doc else ""))
    return "\n".join(out)


def hint(key: str) -> str:
    """Advice for a binding key that is not one of ours: ours for a veRL spelling, else the nearest keys."""
    names = [k.name for k in all_keys()]
    if key in VERL_KEYS:
        return f"veRL's {key} is {VERL_KEYS[key]} here"
    for theirs, ours in VERL_PREFIXES:
        if key.startswith(theirs):
            mapped = ours + key[len(theirs):]
            if mapped in names:
                return f"veRL's {key} is {mapped} here"
            near = difflib.get_close_matches(mapped, names, n=3, cutoff=0.75)
            where = ours + "*"
            return f"veRL's {theirs.rstrip('.')}.* is {where} here" + (f"; did you mean {_or(near)}?" if near else "")
    near = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    return f"did you mean {_or(near)}?" if near else ""


def _or(names: list[str]) -> str:
    return " or ".join(names)


LIST_HINT = "`python -m jaxrl_llm.train --list_keys` lists every key with its default and doc"


def operative_config(run=None) -> str:
    """gin's operative config (every binding the run used, defaults included) with our full section names
    (`rollout.multi_turn.enable`, where gin writes the shortest name that resolves: `multi_turn.enable`).
    With `run` (its RunConfig), the keys gin leaves out (fields a factory fills, e.g. a dict) are added."""
    import gin

    full = {s.rsplit(".", 1)[-1]: s for s in (k.name.rsplit(".", 1)[0] for k in all_keys()) if "." in s}
    out = []
    for line in gin.operative_config_str().splitlines():
        head = re.match(r"^(# Parameters for )?([\w.]+?)(:|\.\w+ = )", line)
        if head and head.group(2) in full:
            line = line.replace(head.group(2), full[head.group(2)], 1)
        out.append(line)
    bound = {line.split(" = ")[0] for line in out if " = " in line}
    rest = [f"{k.name} = {_value(run, k.name)!r}" for k in all_keys() if run is not None and k.name not in bound]
    if rest:
        out += ["", "# Parameters gin leaves out (built by a default factory):", *rest]
    return (f"# The run's operative config: every key it used, defaults included ({LIST_HINT}).\n\n"
            + "\n".join(out) + "\n")


def _value(run, key: str):
    """The value of `key` in a RunConfig."""
    from jaxrl_llm.trainer.config.run import PARTS

    field, section = next((f, s) for f, s, _ in sorted(PARTS, key=lambda p: -len(p[1]))
                          if key.startswith(s + "."))
    node = getattr(run, field)
    for name in key[len(section) + 1:].split("."):
        node = getattr(node, name)
    return node
