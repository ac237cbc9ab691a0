"""The on-storage format: names, manifest and its schema, checksums, safe unpickling, references, drill records."""
