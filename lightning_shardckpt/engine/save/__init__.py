"""The save path: staging on the caller, then persist, verify and commit on a background thread."""
