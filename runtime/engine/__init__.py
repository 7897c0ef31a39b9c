"""Continuous-batching engine: sequences, block manager, scheduler, model runner, sampler."""
