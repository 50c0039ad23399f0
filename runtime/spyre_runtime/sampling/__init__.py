"""Sampling: request parameters, the batched sampler, structured output."""
