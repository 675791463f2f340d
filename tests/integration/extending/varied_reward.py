"""Test support (not in the doc): a deterministic reward that differs between samples (the tiny
random model never solves arithmetic, so rule rewards would all be 0 and every choice a tie)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 97) / 96.0
