"""The training loop's checkpointer: ``CheckpointManager`` and what it runs behind the loop (the
saver thread, restore, retention, the exit and SIGTERM flush, what it reports)."""
