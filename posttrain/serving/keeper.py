"""`python -m posttrain.serving.keeper ARGV...`: a rollout server's command, kept on a leash.

`ServerProcess.start` runs the server through this small process, the leader of the server's
process group, which the kernel sends SIGTERM when the stage process dies (its parent-death
signal: SIGKILL of the stage, an orphaned stage's `os._exit`). On SIGTERM, SIGHUP or SIGINT it
ends the whole group - the server and whatever it started (vLLM's and SGLang's engine processes,
a shell's children) - with SIGTERM, then SIGKILL after a grace period. A parent-death signal
alone would reach only the direct child. When the server exits by itself, the keeper ends the
group's leftovers and exits the same way (the same code, or the same signal), so the stage can
say how its server ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil

GRACE_S = 10  # seconds (signal.alarm's whole seconds)


def _end_leftovers(sig: int) -> None:
    """Send `sig` to every other process of this group."""
    me = os.getpid()
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if p.pid != me and os.getpgid(p.pid) == me:
                p.send_signal(sig)


def main(argv: list[str]) -> None:
    # A plain flag, not a threading.Event: handlers run between bytecodes of the main thread
    # and nest when signals come in a burst (the parent-death SIGTERM, then a SIGHUP ...); a
    # second handler blocking on the lock the first holds inside Event.set() hung the keeper
    # with its server running.
    stopping = [False]

    def stop(signum: int, frame: object) -> None:
        # The main thread is in child.wait(), which resumes after this handler: no waiting and
        # no locks here, only signals, and an alarm for a server that ignores SIGTERM.
        if stopping[0]:
            return
        stopping[0] = True
        signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))
        signal.alarm(GRACE_S)
        _end_leftovers(signal.SIGTERM)

    # Handlers first: a signal between the fork and the handlers would end the keeper alone
    # and leave the server running, orphaned.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop)
    child = subprocess.Popen(argv)
    if stopping[0]:  # asked to stop while the server was being forked
        _end_leftovers(signal.SIGTERM)
    code = child.wait()
    signal.alarm(0)  # the server ended within its grace: no SIGKILL for what is left
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    _end_leftovers(signal.SIGKILL)  # what the server left behind
    if stopping[0]:
        sys.exit(0)
    if code < 0:  # killed by a signal: end the same way
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
