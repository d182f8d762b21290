"""Training: the Trainer (its state_dict is the checkpoint), loss, optimiser and schedule, checkpoints and
their averaging, logs and figures of a run, and the launcher that starts one worker per device."""
