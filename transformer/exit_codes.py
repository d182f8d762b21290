"""The exit-code contract of every command (docs/training.md, "Exit codes")."""
OK = 0
INTERNAL = 1  # a bug: the full traceback is in the log
USER_ERROR = 2  # bad config, data, path, checkpoint or input text: one `error:` line names it
PREEMPTED = 3  # a stop signal (SIGTERM, SIGUSR1, a first Ctrl-C): a checkpoint was written; rerun to resume
DIVERGED = 4  # the loss or gradients stayed non-finite (trainer.nonfinite): one line names the last finite checkpoint
ENVIRONMENT = 5  # not a bug, not bad input: a full disk, a vanished or read-only run directory; one `error:` line
ABORTED = 130  # a second Ctrl-C: ended at once, nothing written (128 + SIGINT, as shells report it)
