"""The OpenAI-compatible HTTP server: routes with their own speculative policy, a batched
engine driven by one scheduler thread, Prometheus metrics and memory accounting."""
