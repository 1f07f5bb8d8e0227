"""Reusable test harness: tiny models, a 2-rank gloo launcher, synthetic GRPO batches."""
