"""Checkpoints: the self-describing run directory (metadata), the Orbax params reader, and the one
"checkpoint -> model" restore that generation, evaluation and verification share."""
