"""One worker per device: wrapping the model for its devices (DDP) and the run directory's lock."""
