"""The inference engine: models, weights, paged KV with prefix caching, scheduler, sampler."""
