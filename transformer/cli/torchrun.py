"""`python -m transformer.cli.torchrun`: torchrun, with the same options, as the launch scripts run it. A run that
ends on purpose ends as under the trainer's own spawn (transformer/training/launcher.py): with the workers' exit
code (transformer/exit_codes.py), rank 0's one line and no traceback.

Plain torchrun clashes with the exit codes twice:
- a stop signal that reaches its agent (Ctrl-C at a terminal reaches the agent and the workers alike; scancel
  signals every process of a Slurm step) raises SignalException there: the agent passes the signal on, waits for
  the workers to checkpoint and exit 3, then ends with the exception's traceback and exit code 1;
- workers that end with one of the trainer's codes after a stop the agent did not see (one that reached another
  node and every rank through the step's all-reduce) are a failure to it, restarted under --max-restarts.
Here a worker ending with 2, 3, 4, 5 or 130 is final: no restart, and the agent exits with that code, whatever it
ran into itself meanwhile (the stop signal; a rendezvous store gone with the agent of another node that ended
first). A second stop signal while the agent waits for the workers is passed on too (a second Ctrl-C: they abort
with 130). Crashes stay torchrun's: restarts, its report, exit code 1.
"""
import signal
import sys
from typing import Dict, Optional

from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher import api as launcher_api

from transformer import exit_codes

# Ends on purpose: a restart would undo a stop (3, 130) or fail the same way (2, 4, 5).
FINAL = (exit_codes.USER_ERROR, exit_codes.PREEMPTED, exit_codes.DIVERGED, exit_codes.ENVIRONMENT,
         exit_codes.ABORTED)


def final_code(codes: Dict[int, int]) -> Optional[int]:
    """The exit code of workers that ended with `codes` ({rank: exit code, negative for a signal}) when they
    ended on purpose: the lowest rank's (global rank 0 is the one that says why). Workers that finished (0) or
    that the agent's SIGTERM ended once another had exited count as nothing. None for a crash (another code
    or signal)."""
    ended = {rank: code for rank, code in codes.items() if code not in (0, -signal.SIGTERM)}
    if not ended or any(code not in FINAL for code in ended.values()):
        return None
    return ended[min(ended)]


class Agent(LocalElasticAgent):
    """torchrun's agent, but workers that ended on purpose are not restarted, a stop signal that comes while it
    waits for the workers is passed on to them as well, and their exit codes are kept for main()."""

    ended: Dict[int, int] = {}  # {local rank: exit code} after the last shutdown; one agent per process

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and final_code({r: f.exitcode for r, f in result.failures.items()}) is not None:
            self._remaining_restarts = 0
        return result

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args, **kwargs) -> None:
        stopping = isinstance(sys.exc_info()[1], SignalException)  # called by run() on a stop signal
        again = None
        while True:
            try:
                super()._shutdown(death_sig, *args, **kwargs)
                break
            except SignalException as e:  # the user's second Ctrl-C, say: the workers get it too, then it ends
                death_sig, again = e.sigval, e
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        type(self).ended = {r: h.proc.returncode for r, h in handlers.items() if h.proc.returncode is not None}
        if again is not None and not stopping:  # a restart's or the end's shutdown: run() handles the signal
            raise again


def main() -> int:
    launcher_api.LocalElasticAgent = Agent  # the class launch_agent builds its agent from, in this process only
    try:
        torchrun.main()
    except ChildFailedError as e:  # the workers ended with these codes, not restarted
        code = final_code({rank: failure.exitcode for rank, failure in e.failures.items()})
        if code is None:
            raise
        return code
    except Exception:  # a stop signal (SignalException), or a lost rendezvous once another node's agent had ended
        code = final_code(Agent.ended)  # the workers' codes, as the agent's shutdown left them
        if code is None:
            raise
        return code
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
