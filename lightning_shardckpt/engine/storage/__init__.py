"""Storage: fsspec locations and backends, bounded retries, DCP's StorageWriter and StorageReader over fsspec."""
