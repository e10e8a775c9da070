"""The scheduler process: gRPC API, tokenizer, queues, KV block bookkeeping and step planning."""
