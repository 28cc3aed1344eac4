"""The options agentq reads before Celery: `agentq worker llm|io --processes N`, each
worker's node name, the default, and the pool a tool worker refuses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from agentq.cli.main import worker_argv
from agentq.cli.options import has_option, take_option
from agentq.cli.supervise import (
    MAX_AUTO_PROCESSES,
    child_opts,
    default_processes,
    supervise,
    take_processes,
)
from agentq.errors import ConfigError
from agentq.local.processes import wait_for


@pytest.mark.parametrize(
    ("opts", "setting", "expected"),
    [
        (["-l", "INFO"], 0, (["-l", "INFO"], None)),
        (["-l", "INFO"], 3, (["-l", "INFO"], 3)),
        (["--processes", "2", "-l", "INFO"], 3, (["-l", "INFO"], 2)),
        (["-l", "INFO", "--processes=5"], 0, (["-l", "INFO"], 5)),
    ],
)
def test_processes_option_is_taken_out_of_celerys(
    opts: list[str], setting: int, expected: tuple[list[str], int | None]
) -> None:
    assert take_processes(opts, setting) == expected


@pytest.mark.parametrize("value", ["0", "65", "two", ""])
def test_a_bad_processes_value_names_the_option(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        take_processes(["--processes", value], 0)
    assert err.value.setting == "--processes"
    assert "1 to 64" in str(err.value)


def test_one_process_keeps_the_options_and_node_name() -> None:
    assert child_opts("llm", ["-n", "a@h", "-l", "INFO"], 0, 1) == ["-n", "a@h", "-l", "INFO"]


@pytest.mark.parametrize(
    "opts",
    [
        ["-n", "edge@box", "-l", "INFO"],
        ["--hostname=edge@box", "-l", "INFO"],
        ["-nedge@box", "-l", "INFO"],
    ],
)
def test_each_of_several_workers_gets_its_own_node_name(opts: list[str]) -> None:
    names = [child_opts("llm", opts, i, 3) for i in range(3)]
    assert names == [["-l", "INFO", "--hostname", f"edge-{i}@box"] for i in (1, 2, 3)]


def test_without_a_node_name_the_kind_names_them() -> None:
    assert child_opts("io", [], 1, 2) == ["--hostname", "io-2@%h"]


def test_the_stream_worker_defaults_to_one_process_per_cpu_up_to_a_cap() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert default_processes("llm") == min(cpus, MAX_AUTO_PROCESSES)
    assert default_processes("io") == 1


@pytest.mark.parametrize(
    "opts",
    [["-P", "threads"], ["-Pthreads"], ["--pool", "threads"], ["--pool=threads"]],
)
def test_every_form_of_an_option_is_read(opts: list[str]) -> None:
    assert has_option(["-l", "INFO", *opts], "-P", "--pool")
    assert take_option(["-l", "INFO", *opts], "-P", "--pool") == ("threads", ["-l", "INFO"])
    # The tool worker reads the pool in each form, and refuses one that cannot kill.
    with pytest.raises(ConfigError) as err:
        worker_argv("tools", opts, ["agentq.tools"])
    assert err.value.setting == "--pool"


def test_the_last_value_given_is_the_one_celery_takes() -> None:
    assert take_option(["-P", "threads", "--pool=prefork"], "-P", "--pool")[0] == "prefork"
    assert take_option(["-l", "INFO", "--pool"], "-P", "--pool") == ("", ["-l", "INFO"])
    assert take_option(["-l", "INFO"], "-P", "--pool") == (None, ["-l", "INFO"])
    assert not has_option(["--pooling", "x", "-l"], "-P", "--pool")


def test_workers_go_without_mingle_and_gossip_once() -> None:
    """Neither serves agentq, and mingle at a reconnect could stop a worker (kombu's
    LimitExceeded on a held broker pool); given again on the command line, once."""
    argv = worker_argv("llm", [], ["agentq.tools"])
    assert argv.count("--without-mingle") == 1 and argv.count("--without-gossip") == 1
    argv = worker_argv("tools", ["--without-mingle"], ["agentq.tools"])
    assert argv.count("--without-mingle") == 1 and argv.count("--without-gossip") == 1


FAKE_WORKERS = """#!/bin/sh
# llm-1 recycles itself once, then its replacement runs until stopped; llm-2 exits 3 once
# the replacement has started.
case "$*" in
  *llm-1@*)
    if [ ! -e {dir}/recycled ]; then : > {dir}/recycled; exit 75; fi
    echo $$ > {dir}/restarted
    exec sleep 60 ;;
  *)
    while [ ! -e {dir}/restarted ]; do sleep 0.02; done
    exit 3 ;;
esac
"""


def test_a_recycled_workers_restart_leaves_the_others_exits_to_the_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Popen dropped while its worker runs is reaped by the next Popen (the restart), not
    # by the supervisor's os.wait(): a worker's exit in that window would go unseen.
    fake = tmp_path / "python"
    fake.write_text(FAKE_WORKERS.format(dir=tmp_path))
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with warnings.catch_warnings():
            # As outside the suite: a Popen dropped while running warns unseen, and is listed.
            warnings.simplefilter("ignore", ResourceWarning)
            rc = supervise("llm", [], 2)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert rc == 3
    with pytest.raises(ProcessLookupError):  # the replacement was stopped and reaped
        os.kill(int((tmp_path / "restarted").read_text()), 0)
    left = [p.pid for p in subprocess._active if p.args[0] == str(fake)]  # type: ignore[attr-defined]
    assert not left, f"workers left for subprocess to reap: {left}"


COUNTING_WORKER = """#!{python}
import os, signal, time
seen = []
signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
open(os.path.join({dir!r}, f"up.{{os.getpid()}}"), "w").close()
while not seen:
    time.sleep(0.01)
time.sleep(0.5)  # as a warm shutdown takes a while: a second SIGINT would come meanwhile
open(os.path.join({dir!r}, f"ints.{{os.getpid()}}"), "w").write(str(len(seen)))
"""


def test_a_terminals_ctrl_c_reaches_each_worker_once(tmp_path: Path) -> None:
    """Ctrl-C signals the terminal's foreground process group, and the supervisor passes
    SIGINT on: a worker in that group got two, and Celery takes a second SIGINT for a cold
    shutdown, which kills the tasks it runs."""
    fake = tmp_path / "python"
    fake.write_text(COUNTING_WORKER.format(python=sys.executable, dir=str(tmp_path)))
    fake.chmod(0o755)
    code = (
        f"import sys; sys.executable = {str(fake)!r}; from agentq.cli.supervise import "
        "supervise; sys.exit(supervise('llm', [], 2))"
    )
    # In a session of its own, as a command started from a terminal is its group's leader.
    sup = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        wait_for(lambda: len(list(tmp_path.glob("up.*"))) == 2, 30)
        os.killpg(sup.pid, signal.SIGINT)  # what the terminal does
        assert sup.wait(30) == 0
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sorted(p.read_text() for p in tmp_path.glob("ints.*")) == ["1", "1"]
