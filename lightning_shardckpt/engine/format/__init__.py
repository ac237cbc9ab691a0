"""The on-storage format: names, manifest and its schema, checksums, safe unpickling, references, drill
records, and the listed-checkpoint entry (`entry`) that catalog, drill records and references share."""
