"""Identity: what a checkpoint was made from (config, data, model, code, run) and how two differ.

`blocks` builds the identity blocks recorded in every manifest; `diff` compares them under a
per-block policy (error / warn / ignore) and renders readable differences.

May import: `..engine` and `..errors`; never a room above it, never Lightning.
"""
