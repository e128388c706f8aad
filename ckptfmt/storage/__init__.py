"""Files on a POSIX file system: shard files, metadata documents, the atomic commit."""
