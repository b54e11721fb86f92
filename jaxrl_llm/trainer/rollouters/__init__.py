"""How batches reach the trainer: the synchronous and asynchronous modes."""
