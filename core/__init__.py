"""backplane: an LLM model executor whose every backend is a plugin."""
