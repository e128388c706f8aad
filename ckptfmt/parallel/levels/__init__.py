"""Where a job's checkpoints live: node-local level 1, the shared level 3 (a directory or a bucket),
the flush between them, retention and making room on a full level."""
