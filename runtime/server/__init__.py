"""OpenAI-compatible HTTP server, its protocol models, errors and Prometheus metrics."""
