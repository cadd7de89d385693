"""Run several grading commands side by side, as the tests that grade a class do, and never leave
one running: on a deadline or any failure here each command still running gets a Ctrl-C (SIGINT),
which makes ``python -m autograder grade`` stop and kill its workers, and is killed 60 s later if it
has not ended by then."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path


def run_at_once(commands: dict[str, list[str]], cwd: Path, env: dict,
                timeout: float) -> dict[str, tuple[int, str]]:
    """Start every command at once; each one's exit code and output (stdout and stderr), by
    name. A command past ``timeout`` seconds raises ``subprocess.TimeoutExpired`` here, after
    every command was stopped."""
    running = {name: subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
               for name, command in commands.items()}
    outputs = {}
    try:
        for name, process in running.items():
            outputs[name] = process.communicate(timeout=timeout)[0]
    finally:
        for process in running.values():
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in running.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return {name: (running[name].returncode, output) for name, output in outputs.items()}
