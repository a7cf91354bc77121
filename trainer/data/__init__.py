"""Training data: corpora, tokenizers, prepared token shards, and batches addressed by iteration."""
