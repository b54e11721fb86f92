"""A custom reward file for the manager tests: loaded by path, like a user's
`custom_reward_function.path`. Misbehaves on purpose for some responses."""

import math
import os


def flaky(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    if solution_str == "boom":
        raise ValueError("boom on purpose")
    if solution_str == "nan":
        return math.nan
    if solution_str == "inf":
        return {"score": math.inf}
    if solution_str == "text":
        return "high"
    return {"score": float(solution_str == ground_truth) + bonus, "pid": os.getpid()}
