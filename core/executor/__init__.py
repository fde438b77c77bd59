"""The executor's spine: the forward batch, the KV pools, the model runner and the graph runner."""
