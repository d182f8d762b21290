"""The training loop: the Trainer (its state_dict is the checkpoint), one step, validation, the end of a run, the
non-finite guard, the step's device-side statistics and the run clock."""
