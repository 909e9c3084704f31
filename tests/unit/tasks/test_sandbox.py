"""Untrusted code in the sandbox (issue 45): tools and reward functions that attack the machine they run on.

Each attack ends its own call (a fatal tool result, a failed sample) with the reason, the calls beside it get
their answers, and the pool keeps serving. Every case runs with `isolation: none` (process limits alone) and
`namespaces` (where `unshare` works here); the network and the filesystem are isolated by namespaces only.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from cluster.job import JobValidationError, check_sandbox, validate_job
from tasks.base import build_task
from tasks.config import DatasetConfig
from tasks.process_tree import kill_tree
from tasks.sandbox import SandboxLimits, namespaces_unavailable
from tasks.scoring import RewardWorkerError, ScorePool
from tasks.tools import ToolCall, ToolPool, ToolWorkerError

ROOT = Path(__file__).resolve().parents[3]
BIG_FILE = "stableasync-sandbox-test-1gb"

ATTACKS = f'''
import os, socket, subprocess, tempfile, time


def fork_bomb() -> str:
    """Fork until refused (300 at most, each asleep for 5 s)."""
    for started in range(300):
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
    return "forked 300"


def orphan(tag: str, hang: bool) -> str:
    """Start `sleep TAG` and leave it running; hang past the timeout when asked."""
    subprocess.Popen(["sleep", tag])
    if hang:
        time.sleep(60)
    return "left it"


def big_file() -> str:
    """Write a 1 GB file (sparse: one byte at 1 GB) in the temp dir."""
    with open(os.path.join(tempfile.gettempdir(), "{BIG_FILE}"), "wb") as file:
        file.seek(1 << 30)
        file.write(b"x")
    return "wrote 1 GB"


def flood() -> str:
    """Write 5,000 characters to file descriptor 1, past sys.stdout."""
    os.write(1, b"FLOOD" * 1000)
    return "flooded"


def secret() -> str:
    """What the environment holds."""
    return " ".join([str(os.environ.get("STABLEASYNC_TEST_SECRET")), str(os.environ.get("STABLEASYNC_TEST_SHARED")),
                     str(os.environ["HOME"] == os.environ["TMPDIR"] == os.getcwd())])


def connect(port: int) -> str:
    """Open a TCP connection to a server on this machine."""
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    return "connected"


def write_outside(path: str) -> str:
    """Write in the private dir, then outside it."""
    with open(os.path.join(os.environ["TMPDIR"], "inside.txt"), "w") as file:
        file.write("mine")
    with open(path, "w") as file:
        file.write("escaped")
    return "wrote outside"


def close_and_hang(tag: str) -> str:
    """Close stdout and stderr, start `sleep TAG` and hang."""
    os.close(1)
    os.close(2)
    subprocess.Popen(["sleep", tag])
    time.sleep(60)
    return "never"


def nap(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "rested"


def echo(text: str) -> str:
    """Say it back."""
    return text


def reward(completion: str, answer: str, row: dict) -> float:
    """A reward function that runs the attack the completion names: [name, arguments] as JSON."""
    name, arguments = __import__("json").loads(completion)
    said = globals()[name](**arguments)
    return float(said == "None listed True") if name == "secret" else 1.0
'''

TOOLS = (
    "fork_bomb",
    "orphan",
    "big_file",
    "flood",
    "secret",
    "connect",
    "write_outside",
    "close_and_hang",
    "nap",
    "echo",
)
TIMEOUT_S = 2.0
LIMITS = dict(max_processes=16, max_file_mb=16, env=("STABLEASYNC_TEST_SHARED",))


def _modes():
    why = namespaces_unavailable()
    return [
        "none",
        pytest.param(
            "namespaces",
            marks=pytest.mark.skipif(why is not None, reason=f"namespaces cannot start on this machine: {why}"),
        ),
    ]


def _alive(tag: str) -> list[int]:
    """Pids of the `sleep TAG` processes still running."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if cmdline.read().split(b"\0")[:2] == [b"sleep", tag.encode()]:
                        with open(f"/proc/{entry}/stat") as stat:
                            state = stat.read().rsplit(")", 1)[1].split()
                            if state[0] != "Z":
                                found.append((int(entry), *state[:4]))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module", autouse=True)
def secrets_in_the_environment():
    """A secret the workers must not see, and a variable the pools pass on by name."""
    os.environ["STABLEASYNC_TEST_SECRET"] = "hunter2"
    os.environ["STABLEASYNC_TEST_SHARED"] = "listed"
    yield
    del os.environ["STABLEASYNC_TEST_SECRET"], os.environ["STABLEASYNC_TEST_SHARED"]


@pytest.fixture(scope="module")
def attacks(tmp_path_factory):
    source = tmp_path_factory.mktemp("attacks") / "attacks.py"
    source.write_text(ATTACKS)
    yield str(source)
    for tag in ("987.1", "987.2", "987.3", "987.4", "987.5", "987.6"):  # what today's code would leave
        for pid, *_ in _alive(tag):
            os.kill(pid, signal.SIGKILL)
    Path(tempfile.gettempdir(), BIG_FILE).unlink(missing_ok=True)


@pytest.fixture(scope="module", params=_modes())
def tools(request, attacks):
    with ToolPool(
        [f"{attacks}:{name}" for name in TOOLS],
        workers=2,
        timeout_s=TIMEOUT_S,
        max_output_chars=100,
        limits=SandboxLimits(isolation=request.param, **LIMITS),
    ) as pool:
        yield pool


def _run(pool, *calls):
    return pool.run_many([(ToolCall(name, arguments), None) for name, arguments in calls])


def _fatal(result, start):
    assert result.fatal, result
    assert result.error.startswith(start), result.error
    return result.error


def test_a_fork_bomb_stops_at_the_process_limit(tools):
    bomb, after = _run(tools, ("fork_bomb", {}), ("echo", {"text": "after"}))
    _fatal(bomb, "tool fork_bomb raised BlockingIOError: [Errno 11] Resource temporarily unavailable")
    assert after.content == "after"


def test_a_child_that_outlives_its_call_dies_with_it(tools):
    hung, left, after = _run(
        tools,
        ("orphan", {"tag": "987.1", "hang": True}),
        ("orphan", {"tag": "987.2", "hang": False}),
        ("echo", {"text": "after"}),
    )
    assert _fatal(hung, "tool orphan timed out after 2 s")
    assert left.content == "left it" and after.content == "after"
    time.sleep(0.2)
    assert _alive("987.1") == [] and _alive("987.2") == []


def test_a_1_gb_file_is_refused_at_the_file_size_limit(tools):
    big, after = _run(tools, ("big_file", {}), ("echo", {"text": "after"}))
    _fatal(big, "tool big_file raised OSError: [Errno 27] File too large")
    assert after.content == "after"
    assert not Path(tempfile.gettempdir(), BIG_FILE).exists()  # its temp dir was its own, and is emptied


def test_a_flood_on_file_descriptor_1_is_cut_and_never_reaches_the_caller(tools, capfd):
    flood, after = _run(tools, ("flood", {}), ("echo", {"text": "after"}))
    _fatal(flood, "tool flood wrote more than 100 bytes to stdout/stderr (max_output_chars)")
    assert after.content == "after"
    assert "FLOOD" not in capfd.readouterr().out


def test_the_environment_is_an_allowlist_and_home_is_the_private_dir(tools):
    (result,) = _run(tools, ("secret", {}))
    assert result.content == "None listed True"


def test_a_tool_that_closes_its_stdout_and_hangs_is_killed_whole(tools):
    started = time.monotonic()
    hung, after = _run(tools, ("close_and_hang", {"tag": "987.3"}), ("echo", {"text": "after"}))
    _fatal(hung, "tool close_and_hang timed out after 2 s")
    assert after.content == "after" and time.monotonic() - started < 30
    time.sleep(0.2)
    assert _alive("987.3") == []


def test_namespaces_cut_the_network_and_write_only_the_private_dir(tools, tmp_path):
    if tools.isolation != "namespaces":
        pytest.skip("isolation none leaves the network and the filesystem open (docs/security.md)")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        outside = tmp_path / "outside.txt"
        connect, write, after = _run(
            tools,
            ("connect", {"port": server.getsockname()[1]}),
            ("write_outside", {"path": str(outside)}),
            ("echo", {"text": "after"}),
        )
    _fatal(connect, "tool connect raised OSError: [Errno 101] Network is unreachable")
    _fatal(write, "tool write_outside raised OSError: [Errno 30] Read-only file system")
    assert after.content == "after" and not outside.exists()


def test_calls_of_different_episodes_run_in_parallel_up_to_the_workers(tools):
    results = []

    def episode():
        results.extend(_run(tools, ("nap", {"seconds": 1.0})))

    started = time.monotonic()
    threads = [threading.Thread(target=episode) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.content for r in results] == ["rested", "rested"]
    assert time.monotonic() - started < 1.8, "two episodes' calls on two workers ran one after the other"


# ---------------------------------------------------------------- a user's reward function, the same attacks


@pytest.fixture(scope="module", params=_modes())
def rewards(request, attacks, tmp_path_factory):
    data = tmp_path_factory.mktemp("data") / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "attack", "answer": "1"}) + "\n")
    config = DatasetConfig(path=str(data), reward=f"{attacks}:reward")
    problem = next(build_task("dataset", config).problems("train", 0))
    with ScorePool(
        "dataset",
        config,
        max_workers=2,
        timeout_s=TIMEOUT_S,
        limits=SandboxLimits(isolation=request.param, max_output_chars=100, **LIMITS),
    ) as pool:
        yield pool, problem


def _score(rewards, *attacks):
    pool, problem = rewards
    return pool.score_many([problem] * len(attacks), [json.dumps(attack) for attack in attacks])


def test_a_reward_function_s_attacks_fail_their_own_samples(rewards, capfd, tmp_path):
    results = _score(
        rewards,
        ["fork_bomb", {}],
        ["orphan", {"tag": "987.4", "hang": True}],
        ["orphan", {"tag": "987.5", "hang": False}],
        ["big_file", {}],
        ["flood", {}],
        ["close_and_hang", {"tag": "987.6"}],
        ["echo", {"text": "fine"}],
    )
    errors = [r.error for r in results]
    assert errors[0].startswith("raised BlockingIOError: [Errno 11]"), errors[0]
    assert errors[1] == "timeout after 2 s"
    assert errors[2] is None  # it returned; the child it left is killed with its process group
    assert errors[3].startswith("raised OSError: [Errno 27] File too large"), errors[3]
    assert errors[4] == "wrote more than 100 bytes to stdout/stderr (sandbox max_output_chars)"
    assert errors[5] == "timeout after 2 s"
    assert errors[6] is None and [r.reward for r in results] == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    time.sleep(0.2)
    assert _alive("987.4") == _alive("987.5") == _alive("987.6") == []
    assert "FLOOD" not in capfd.readouterr().out


def test_a_reward_function_reads_no_secret_and_in_namespaces_reaches_no_network_or_file(rewards, tmp_path):
    pool, _ = rewards
    (secret,) = _score(rewards, ["secret", {}])
    assert (secret.reward, secret.error) == (1.0, None)  # no secret, the listed variable, HOME the private dir
    if pool.isolation != "namespaces":
        return
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        outside = tmp_path / "outside.txt"
        connect, write = _score(
            rewards, ["connect", {"port": server.getsockname()[1]}], ["write_outside", {"path": str(outside)}]
        )
    assert connect.error.startswith("raised OSError: [Errno 101] Network is unreachable"), connect.error
    assert write.error.startswith("raised OSError: [Errno 30] Read-only file system"), write.error
    assert not outside.exists()


def test_cpu_time_past_the_limit_fails_the_call(attacks, tmp_path):
    spin = tmp_path / "spin.py"
    spin.write_text("def spin() -> str:\n    '''Spin.'''\n    while True:\n        pass\n")
    with ToolPool([f"{spin}:spin", f"{attacks}:echo"], timeout_s=10, limits=SandboxLimits(cpu_s=1)) as pool:
        spun, after = _run(pool, ("spin", {}), ("echo", {"text": "after"}))
    _fatal(spun, "tool spin used more than 1 CPU seconds (sandbox cpu_s)")
    assert after.content == "after"


# ---------------------------------------------------------------- killing a worker's tree

SPAWNER = """
import contextlib, ctypes, os, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER, as a sandbox worker is
while True:  # a worker that keeps starting items: each one leaves `sleep TAG` in a group of its own, orphaned here
    if os.fork() == 0:
        os.setpgid(0, 0)
        if os.fork() == 0:
            os.execvp("sleep", ["sleep", sys.argv[1]])
        os._exit(0)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:  # reap what has exited
            pass
    time.sleep(0.0005)
"""


@pytest.mark.parametrize("round_", range(5))
def test_killing_a_tree_whose_root_keeps_forking_leaves_nothing_alive(round_):
    """The root is stopped before its tree is killed: one left running would start children after the last
    look at its tree, and they would outlive it (a sandbox worker killed while it forks an item)."""
    tag = f"986.{round_}"
    root = subprocess.Popen([sys.executable, "-c", SPAWNER, tag], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(_alive(tag)) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(_alive(tag)) >= 20, "the spawner did not start its children"
        assert kill_tree(root.pid) == set()
        root.wait(timeout=10)
        time.sleep(0.2)
        assert _alive(tag) == []
    finally:
        for pid, *_ in _alive(tag):
            os.kill(pid, signal.SIGKILL)
        root.kill()
        root.wait()


# ---------------------------------------------------------------- bad settings: named, nothing starts


MINIMAL = {"task": {"name": "arithmetic"}}


def test_sandbox_limits_of_zero_or_below_are_refused_by_name():
    with pytest.raises(JobValidationError) as refused:
        validate_job(
            {
                **MINIMAL,
                "sandbox": {
                    "cpu_s": 0,
                    "max_processes": -1,
                    "max_file_mb": 0,
                    "max_open_files": 0,
                    "max_output_chars": -5,
                    "isolation": "chroot",
                    "env": ["A B"],
                },
            }
        )
    fields = {error.path for error in refused.value.errors}
    assert fields == {
        f"sandbox.{name}"
        for name in ("cpu_s", "max_processes", "max_file_mb", "max_open_files", "max_output_chars", "isolation")
    } | {"sandbox.env.0"}
    assert validate_job(MINIMAL).sandbox.isolation == "auto"


def test_namespaces_that_cannot_start_are_refused_at_validate_and_by_the_pools(monkeypatch, tmp_path, capsys):
    import tasks.sandbox as sandbox
    from cluster.cli import main as cli_main

    monkeypatch.setattr(sandbox, "namespaces_unavailable", lambda: "unshare: write failed /proc/self/uid_map")
    job = validate_job({**MINIMAL, "sandbox": {"isolation": "namespaces"}})
    with pytest.raises(
        JobValidationError,
        match=r"sandbox\.isolation: namespaces cannot start on this machine: "
        r"unshare: write failed",
    ):
        check_sandbox(job)
    check_sandbox(validate_job({**MINIMAL, "sandbox": {"isolation": "auto"}}))  # auto falls back to none
    path = tmp_path / "job.yaml"
    runs = tmp_path / "runs"
    path.write_text(f"task: {{name: arithmetic}}\nsandbox: {{isolation: namespaces}}\nlogging: {{run_dir: {runs}}}\n")
    assert cli_main(["validate", str(path)]) == 2
    assert "sandbox.isolation: namespaces cannot start" in capsys.readouterr().err
    assert cli_main(["train", str(path)]) == 2
    assert "sandbox.isolation: namespaces cannot start" in capsys.readouterr().err
    assert not runs.exists(), "no run directory for a job that never started"
    with pytest.raises(ToolWorkerError, match=r"sandbox.isolation: namespaces cannot start"):
        ToolPool(["calculator"], limits=SandboxLimits(isolation="namespaces"))
    with pytest.raises(RewardWorkerError, match=r"sandbox.isolation: namespaces cannot start"):
        ScorePool("arithmetic", None, limits=SandboxLimits(isolation="namespaces"))
    with ToolPool(["calculator"], limits=SandboxLimits(isolation="auto")) as pool:
        assert pool.isolation == "none"
        assert _run(pool, ("calculator", {"expression": "6 * 7"}))[0].content == "42"


def test_the_sandbox_settings_are_documented():
    from cluster.job import SandboxSection

    security = (ROOT / "docs" / "security.md").read_text()
    assert all(f"`sandbox.{name}`" in security for name in SandboxSection.model_fields)
    assert all(field.description for field in SandboxSection.model_fields.values())


# ---------------------------------------------------------------- as a user who is not root

NOT_ROOT = 65534  # nobody
AS_USER = [
    "setpriv",
    f"--reuid={NOT_ROOT}",
    f"--regid={NOT_ROOT}",
    "--clear-groups",
    "--inh-caps=-all",
    "--bounding-set=-all",
]  # no capability left
AS_NOT_ROOT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from tasks.sandbox import SandboxLimits, namespaces_unavailable
from tasks.tools import ToolCall, ToolPool

attacks, port, outside = sys.argv[2], int(sys.argv[3]), sys.argv[4]
report = {"uid": os.getuid(), "why": namespaces_unavailable()}
if report["why"] is None:
    limits = SandboxLimits(isolation="namespaces", max_processes=16, max_file_mb=16)
    with ToolPool([f"{attacks}:{name}" for name in ("connect", "write_outside", "secret", "echo")], workers=2,
                  timeout_s=5.0, max_output_chars=100, limits=limits) as pool:
        results = pool.run_many([(ToolCall(name, arguments), None) for name, arguments in (
            ("connect", {"port": port}), ("write_outside", {"path": outside}), ("secret", {}),
            ("echo", {"text": "after"}))])
    report["results"] = [[r.fatal, r.error, r.content] for r in results]
print(json.dumps(report))
"""


def _python_for(uid: int) -> str:
    """A Python of this version that the user may run inside a user namespace: the system's, else this one
    (a pyenv under /root is out of the user's reach); the sandbox and the tools need the standard library alone."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (f"/usr/bin/{version}", f"/usr/local/bin/{version}", sys.executable):
        probe = [*AS_USER, "unshare", "--user", "--map-root-user", python, "-I", "-c", "pass"]
        if Path(python).exists() and subprocess.run(probe, capture_output=True).returncode == 0:
            return python
    pytest.skip(f"no {version} that user {uid} may run (this one is {sys.executable})")


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="a test process that is not root cannot become another user (setpriv as root)",
)
def test_namespaces_isolate_a_worker_that_is_not_root():
    """Ray workers usually run as a user who is not root: the namespaced sandbox starts through unprivileged
    user namespaces there (where the kernel allows them; else it says why) and cuts the network, the writes
    outside its private dir and the environment as it does for root."""
    python = _python_for(NOT_ROOT)
    work = Path(tempfile.mkdtemp(prefix="stableasync-not-root-"))
    try:
        work.chmod(0o777)
        (work / "attacks.py").write_text(ATTACKS)
        (work / "run.py").write_text(AS_NOT_ROOT)
        for path in work.iterdir():
            path.chmod(0o644)
        outside = work / "outside.txt"
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            ran = subprocess.run(
                [
                    *AS_USER,
                    python,
                    "-I",
                    str(work / "run.py"),
                    str(ROOT),
                    str(work / "attacks.py"),
                    str(server.getsockname()[1]),
                    str(outside),
                ],
                env={
                    "PATH": os.environ["PATH"],
                    "HOME": str(work),
                    "TMPDIR": str(work),
                    "STABLEASYNC_TEST_SECRET": "hunter2",
                },
                capture_output=True,
                text=True,
                timeout=120,
            )
        assert ran.returncode == 0, ran.stderr[-2000:]
        report = json.loads(ran.stdout.strip().splitlines()[-1])
        assert report["uid"] == NOT_ROOT
        if report["why"] is not None:
            pytest.skip(f"namespaces cannot start here for a user who is not root: {report['why']}")
        connect, write, secret, echo = report["results"]
        assert connect[0] and connect[1].startswith("tool connect raised OSError: [Errno 101] Network is unreachable")
        assert write[0] and write[1].startswith("tool write_outside raised OSError: [Errno 30] Read-only file system")
        assert not outside.exists()
        assert secret == [False, None, "None None True"]  # no secret; HOME, TMPDIR and the cwd its private dir
        assert echo == [False, None, "after"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
