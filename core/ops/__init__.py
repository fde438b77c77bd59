"""Custom ops: native implementations, the builtin plugin registering them, and per-platform dispatch."""
