"""Train: the drafter worker process (wire client, torch.distributed group, optimizer, checkpoints)."""
