"""The HTTP front end: OpenAI-compatible speech, models, health and metrics."""
