"""The executor process: model, paged KV cache, attention backends and sampler."""
