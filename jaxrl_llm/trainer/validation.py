"""Validation metrics with veRL's names and method (`process_validation_metrics`), plus pass@k.

Every validation prompt is answered `rollout.val_n` times (N). For each data source and each variable
(`reward`, the score of a response, and every numeric key the reward function returns, e.g. `acc`), per
prompt, then averaged over the prompts:

  mean@N, std@N              the mean and std of the prompt's N values;
  best@n/{mean,std}          for n = 2, 4, 8, ... < N and n = N: 1000 bootstrap subsets of n of the N
  worst@n/{mean,std}         values (drawn with replacement, seed 42, veRL's draw), the mean and std of
                             each subset's max (best) and min (worst);
  maj@n/{mean,std}           the same for majority voting when the reward returns a `pred`: the value of
                             the first response that gave the most common prediction of the subset.

Keys are `val-core/<source>/<var>/<metric>` for the core variable (`acc` when the reward returns it,
else `reward`) and its mean, best and maj metrics at n = N; everything else is `val-aux/...` (veRL's
split). With N = 1 that is `val-core/<source>/reward/mean@1` alone, for a reward that returns a number.

We add `val-core/<source>/reward/pass@k` for k = 1, 2, 4, ... <= N and k = N (when N > 1): the
unbiased estimator 1 - C(N - c, k) / C(N, k) of a prompt with c correct responses, averaged over
prompts. A response is correct when its `acc` is > 0.5 if the reward returns `acc`, else when its score
is > 0.5. And `val-core/mean`: the mean score of every validation response.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000
BOOTSTRAP_SEED = 42
_CHUNK = 32  # prompts a vectorised bootstrap handles at once (bounds the [P, B, n, n] majority array)


def subset_sizes(n: int) -> list[int]:
    """veRL's bootstrap subset sizes for N = n responses: 2, 4, 8, ... below n, then n ([] for n <= 1)."""
    if n <= 1:
        return []
    sizes, m = [], 2
    while m < n:
        sizes.append(m)
        m *= 2
    return sizes + [n]


def pass_at_k_sizes(n: int) -> list[int]:
    """k = 1, 2, 4, ... <= n, and n itself."""
    sizes, k = [], 1
    while k <= n:
        sizes.append(k)
        k *= 2
    return sizes if sizes[-1] == n else sizes + [n]


def compute_pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with c correct of n responses: 1 - C(n - c, k) / C(n, k).

    Computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i), which needs no large binomials.
    """
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k: need 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def bootstrap_indices(n_data: int, subset_size: int, *, n_bootstrap: int = N_BOOTSTRAP,
                      seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """[n_bootstrap, subset_size] draws with replacement from range(n_data): the very draws veRL's
    `bootstrap_metric` makes (it reseeds numpy's global generator with `seed` on every call)."""
    return np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, subset_size), replace=True)


def bootstrap_best_worst(values: np.ndarray, subset_size: int, *, n_bootstrap: int = N_BOOTSTRAP,
                         seed: int = BOOTSTRAP_SEED) -> tuple[np.ndarray, ...]:
    """Best-of-n and worst-of-n by bootstrap, per prompt.

    Args:
      values: [P, N] float, the N values of each prompt.
    Returns:
      (best mean, best std, worst mean, worst std), each [P] float64.
    """
    values = np.asarray(values, np.float64)
    idx = bootstrap_indices(values.shape[1], subset_size, n_bootstrap=n_bootstrap, seed=seed)
    out = [[], [], [], []]
    for p0 in range(0, len(values), _CHUNK):
        sub = values[p0:p0 + _CHUNK][:, idx]  # [P, B, n]
        best, worst = sub.max(-1), sub.min(-1)  # [P, B]
        for acc, x in zip(out, (best.mean(-1), best.std(-1), worst.mean(-1), worst.std(-1))):
            acc.append(x)
    return tuple(np.concatenate(x) if x else np.zeros(0) for x in out)


def bootstrap_majority(values: np.ndarray, votes: np.ndarray, subset_size: int, *, n_bootstrap: int = N_BOOTSTRAP,
                       seed: int = BOOTSTRAP_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Majority voting by bootstrap, per prompt: in each subset, the value of the first response whose
    vote is the most common (ties: the vote seen first), as veRL's `calc_maj_val`.

    Args:
      values: [P, N] float.
      votes: [P, N] int, equal ints for equal predictions.
    Returns:
      (mean, std), each [P] float64.
    """
    values = np.asarray(values, np.float64)
    idx = bootstrap_indices(values.shape[1], subset_size, n_bootstrap=n_bootstrap, seed=seed)
    means, stds = [], []
    for p0 in range(0, len(values), _CHUNK):
        v, c = values[p0:p0 + _CHUNK][:, idx], votes[p0:p0 + _CHUNK][:, idx]  # [P, B, n]
        count = (c[..., :, None] == c[..., None, :]).sum(-1)  # [P, B, n] votes like each response's
        first = np.argmax(count == count.max(-1, keepdims=True), axis=-1)  # [P, B]
        maj = np.take_along_axis(v, first[..., None], axis=-1)[..., 0]
        means.append(maj.mean(-1))
        stds.append(maj.std(-1))
    return (np.concatenate(means), np.concatenate(stds)) if means else (np.zeros(0), np.zeros(0))


def _vote_codes(preds: Sequence[Any]) -> list[int]:
    codes: dict[Any, int] = {}
    return [codes.setdefault(p, len(codes)) for p in preds]


def _prompt_metrics(per_prompt: list[list[float]], preds: list[list | None], *, seed: int,
                    n_bootstrap: int) -> dict[str, list[float]]:
    """metric name -> one value per prompt that has it (veRL's per-prompt metrics of one variable)."""
    out: dict[str, list[float]] = defaultdict(list)
    by_size: dict[tuple[int, bool], list[int]] = defaultdict(list)
    for i, vals in enumerate(per_prompt):
        by_size[(len(vals), preds[i] is not None)].append(i)
    # Prompts are grouped by size only to vectorise; each metric is still one value per prompt, and the
    # prompts' order within a metric does not change its mean.
    for (n, has_pred), rows in by_size.items():
        v = np.asarray([per_prompt[i] for i in rows], np.float64)  # [P, n]
        out[f"mean@{n}"].extend(v.mean(-1).tolist())
        if n <= 1:
            continue
        out[f"std@{n}"].extend(v.std(-1).tolist())
        votes = np.asarray([_vote_codes(preds[i]) for i in rows]) if has_pred else None
        for m in subset_sizes(n):
            bm, bs, wm, ws = bootstrap_best_worst(v, m, n_bootstrap=n_bootstrap, seed=seed)
            out[f"best@{m}/mean"].extend(bm.tolist())
            out[f"best@{m}/std"].extend(bs.tolist())
            out[f"worst@{m}/mean"].extend(wm.tolist())
            out[f"worst@{m}/std"].extend(ws.tolist())
            if has_pred:
                mm, ms = bootstrap_majority(v, votes, m, n_bootstrap=n_bootstrap, seed=seed)
                out[f"maj@{m}/mean"].extend(mm.tolist())
                out[f"maj@{m}/std"].extend(ms.tolist())
    return out


def _as_number(value) -> float | None:
    """A numeric (or bool) value as a float; None for None, strings and other non-numbers (skipped)."""
    if value is None or isinstance(value, str):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def compute_validation_metrics(data_sources: Sequence[str], uids: Sequence[Any], infos: dict[str, Sequence[Any]], *,
                               seed: int = BOOTSTRAP_SEED, n_bootstrap: int = N_BOOTSTRAP) -> dict[str, float]:
    """veRL's validation metrics (val-core / val-aux), our pass@k and `val-core/mean`.

    Args:
      data_sources: [R] the data source of each response.
      uids: [R] which prompt each response answers (equal for the responses of one prompt).
      infos: variable -> [R] values; must hold "reward" (the scores); `pred` (any hashable) enables
        maj@n; None values, strings and other non-numbers are left out of a variable.
    """
    r = len(data_sources)
    if "reward" not in infos or any(len(v) != r for v in infos.values()) or len(uids) != r:
        raise ValueError(f"validation metrics: need infos['reward'] and every info, uids and data_sources of one "
                         f"length ({r}); got uids {len(uids)}, infos {({k: len(v) for k, v in infos.items()})}")
    # source -> uid -> response indices, in order of first appearance
    groups: dict[str, dict[Any, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (src, uid) in enumerate(zip(data_sources, uids)):
        groups[src][uid].append(i)
    pred = infos.get("pred")
    metrics: dict[str, float] = {}
    for src, prompts in groups.items():
        var_metrics: dict[str, dict[str, float]] = {}
        for var, vals in infos.items():
            per_prompt, preds = [], []
            for idx in prompts.values():
                nums = [_as_number(vals[i]) for i in idx]
                nums = [x for x in nums if x is not None]
                if not nums:
                    continue
                p = [pred[i] for i in idx] if pred is not None else None
                has_pred = p is not None and len(p) == len(nums) and all(x is not None for x in p)
                per_prompt.append(nums)
                preds.append(p if has_pred else None)
            if per_prompt:
                per = _prompt_metrics(per_prompt, preds, seed=seed, n_bootstrap=n_bootstrap)
                var_metrics[var] = {name: float(np.mean(v)) for name, v in per.items()}
        core_var = "acc" if "acc" in var_metrics else "reward"
        for var, named in var_metrics.items():
            n_max = max(int(name.split("@")[1].split("/")[0]) for name in named)
            for name, value in named.items():
                n = int(name.split("@")[1].split("/")[0])
                core = var == core_var and name.startswith(("mean", "maj", "best")) and n == n_max
                metrics[f"{'val-core' if core else 'val-aux'}/{src}/{var}/{name}"] = value
        metrics.update(_pass_at_k_metrics(src, prompts, infos))
    metrics["val-core/mean"] = float(np.mean(np.asarray(infos["reward"], np.float64))) if r else 0.0
    return metrics


def _pass_at_k_metrics(src: str, prompts: dict[Any, list[int]], infos: dict[str, Sequence[Any]]) -> dict[str, float]:
    """`val-core/<src>/reward/pass@k` (N > 1 only): correct is acc > 0.5 when the reward returns acc."""
    acc = infos.get("acc")
    use_acc = acc is not None and any(acc[i] is not None for idx in prompts.values() for i in idx)
    per_k: dict[int, list[float]] = defaultdict(list)
    n_max = max(len(idx) for idx in prompts.values())
    if n_max <= 1:
        return {}
    for idx in prompts.values():
        if use_acc:
            correct = [(_as_number(acc[i]) or 0.0) > 0.5 for i in idx]
        else:
            correct = [float(infos["reward"][i]) > 0.5 for i in idx]
        n, c = len(idx), int(sum(correct))
        for k in pass_at_k_sizes(n):
            per_k[k].append(compute_pass_at_k(n, c, k))
    return {f"val-core/{src}/reward/pass@{k}": float(np.mean(v)) for k, v in sorted(per_k.items())}


class ValidationResults:
    """Collects the scored validation responses chunk by chunk; `metrics()` reduces them."""

    def __init__(self):
        self.data_sources: list[str] = []
        self.uids: list[Any] = []
        self.infos: dict[str, list] = {"reward": []}

    def add(self, data_sources: Sequence[str], uids: Sequence[Any], scores: np.ndarray,
            extra_info: dict[str, list]) -> None:
        """One chunk: [R] data sources, prompt ids, scores and the reward's extra info ([R] lists).

        An extra-info key named "reward" is left out: the score is the reward.
        """
        before, n = len(self.uids), len(scores)
        for key, vals in extra_info.items():
            if key != "reward":
                self.infos.setdefault(key, [None] * before).extend(vals)
        self.infos["reward"].extend(float(s) for s in scores)
        self.data_sources.extend(data_sources)
        self.uids.extend(uids)
        for vals in self.infos.values():  # keys this chunk did not report
            vals.extend([None] * (before + n - len(vals)))

    def metrics(self) -> dict[str, float]:
        return compute_validation_metrics(self.data_sources, self.uids, self.infos)
