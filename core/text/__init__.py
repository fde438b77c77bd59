"""Text around the token ids: the tokenizer (tokenizer.py), incremental detokenizing that never
takes text back (detokenize.py) and one request's stream of chunks (stream.py)."""
