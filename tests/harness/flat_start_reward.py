"""A reward for verl's custom_reward_function that starts flat: the first `flat_calls` responses scored in
this process all get 0 (every group shares one reward, so no sequence has a loss term: what a GRPO run
meets in its first steps, made certain), then 0 or 1 by a hash of the response, which differs within
almost every group of a random policy. Loaded by verl from this file's path."""

import zlib

_scored = 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None, flat_calls: int = 64, **kwargs) -> float:
    global _scored
    _scored += 1
    if _scored <= flat_calls:
        return 0.0
    return float(zlib.crc32(solution_str.encode()) % 2)
