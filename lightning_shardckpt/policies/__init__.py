"""Policies that run during training (as plug-ins) and on the command line: retention, health rules and
mitigations, restore drills, tiers. Nothing here imports Lightning."""
