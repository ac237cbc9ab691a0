"""Operator library: what people and cron jobs run on a checkpoint root, with no training loop.

The public operator API (`roots`: list a root, resolve a reference, a manifest summary, follow new
commits), full verification (`verify`), garbage collection of uncommitted directories (`gc`), investigation
(`investigate`: diff, timeline; `bisect`, `checks`, `compare`), export to other formats (`export`,
`export_formats`) and health reports (`health_report`). The `shardckpt` command (`..cli`) is their
front door; retention, health rules, drills and tiers live in `..policies`.

May import: `..errors`, `..engine`, `..identity`, `..policies`, `..training`; never `..lightning`,
`..cli` or Lightning: a root can be verified, listed and cleaned by code that knows nothing about the
training loop that wrote it.
"""
