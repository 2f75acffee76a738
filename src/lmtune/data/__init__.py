"""Reading, tokenizing, batching and sharding of training data."""
