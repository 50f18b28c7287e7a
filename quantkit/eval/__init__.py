"""Evaluation: paper-protocol WikiText-2 perplexity, lm-eval tasks, and loading artifacts for eval."""
