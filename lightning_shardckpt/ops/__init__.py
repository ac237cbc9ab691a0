"""Operator tools: what people and cron jobs run on a checkpoint root.

The `shardckpt` CLI and what it calls: full verification, garbage collection of uncommitted
directories, retention, and investigation (`diff`, `timeline`).

May import: `..engine`, `..identity`, `..errors`. Never Lightning or `..lightning`: a root can be
verified, listed and cleaned by code that knows nothing about the training loop that wrote it.
"""
