"""Model classes (the Llama family), checkpoint loading, dummy-weight presets and the byte tokenizer."""
