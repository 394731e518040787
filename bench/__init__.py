"""Benchmarks, trace replay and comparisons. Figures are ratios against a baseline run in the same
process, since the machines these run on are shared and noisy."""
