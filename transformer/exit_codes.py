"""The exit-code contract of every command (README, "Exit codes")."""
OK = 0
INTERNAL = 1  # a bug: the full traceback is in the log
USER_ERROR = 2  # bad config, data, path, checkpoint or input text: one `error:` line names it
PREEMPTED = 3  # a stop signal: a checkpoint was written; rerun the same command to resume
