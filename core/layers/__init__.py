"""Building blocks of the models: tensor-parallel linear layers, embeddings, norms, rotary, attention, logits."""
