"""Side-by-side benchmarks: each case in a fresh process, the baseline beside it, ratios reported."""
