"""The `shardckpt` command: the top-floor front door. Nothing in the package imports it."""
