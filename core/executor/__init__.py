"""The executor's spine: the model runner, the graph runner and graph sizes, torch.compile (the batch,
the pools and the backend contracts it runs on are in backplane.contracts)."""
