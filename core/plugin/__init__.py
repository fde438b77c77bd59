"""The plugin machinery: hook specs, discovery, the register callbacks and backend selection."""
