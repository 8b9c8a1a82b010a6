"""Shared by the tests: the test environment, where the real-text corpora are, the one-line error contract, and
the frozen-rank drill of the distributed scripts."""
import json
import locale
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# One OpenMP thread, here and in every script the tests start (they inherit the environment): the tests' models are
# tiny, and two threads that wait for each other on a busy 2-core machine made their steps 10x slower. It is set
# before any test module imports torch. An OMP_NUM_THREADS of your own is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
# CI puts the shared corpora beside the checkout; a fresh clone without them still passes (tests skip).
CORPORA = Path(os.environ.get("CORPORA_DIR", REPO.parent / "shared" / "corpora"))


@pytest.fixture(scope="session")
def corpus():
    """corpus("udhr.jsonl") -> its path, or a skip with the reason when the shared corpora are absent."""
    def find(name):
        path = CORPORA / name
        if not path.exists():
            pytest.skip(f"{path} not found: the shared real-text corpora are not beside this checkout")
        return path
    return find


def assert_one_error_line(result, *fragments):
    """A user mistake's contract: exit status 1, nothing but one `error: ...` line on stderr (no traceback)."""
    assert result.returncode == 1, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def child_with_env(parent_pid, entry):
    """The pid of a child of parent_pid whose environment holds entry (e.g. "RANK=1"), found through Linux's /proc;
    None if there is none yet."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == parent_pid and b"\0" + entry.encode() + b"\0" in b"\0" + (stat.parent / "environ").read_bytes():
                return int(stat.parent.name)
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile, or not ours to read
    return None


def freeze_rank_1(launcher, ready, seconds=6):
    """The frozen-rank drill on a torchrun launcher: once ready() returns, stop rank 1 (SIGSTOP) for `seconds`
    (twice --timeout: rank 0 has given up by then), then continue it so that torchrun's SIGTERM ends it at once.
    Returns (stdout, stderr, seconds from the freeze to the launcher's exit); the processes never outlive the test."""
    frozen = None
    try:
        ready()
        frozen = child_with_env(launcher.pid, "RANK=1")
        assert frozen is not None, "rank 1's process not found"
        os.kill(frozen, signal.SIGSTOP)
        started = time.time()
        time.sleep(seconds)
        os.kill(frozen, signal.SIGCONT)
        stdout, stderr = launcher.communicate(timeout=90)
        return stdout, stderr, time.time() - started
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


# === plumbing: the script runner, one torch import for many short runs ==========================================
# Most of a short run of train.py or sample.py is the interpreter's start and torch's import (~2 s of CPU). The
# runner starts one Python process per environment that imports the third-party libraries once (never the repo's
# modules: a script imports those itself), then forks a child per run: the child takes the run's argv, cwd and
# stdio, runs the script as `python script.py` does (in __main__, sys.path[0] its directory) and exits as the
# interpreter does. Nothing runs between two children, so no state passes from one run to the next; a server per
# environment, so what the imports read from it (OMP_NUM_THREADS, PYTHONIOENCODING) is the run's. What differs
# from a fresh interpreter: torch is in sys.modules before the script imports it, and the children share one
# str hash seed. For refusals and plain runs; tests of signals, torchrun or a process's death start real ones.
SERVER = r'''
import importlib.util, json, os, sys, tempfile
sys.path.remove("") if "" in sys.path else None  # the children set sys.path[0] to their script's directory

# Anything the imports print (a warning) goes to every fresh run's output: then the runner steps aside.
printed_file = tempfile.TemporaryFile()
saved_stdout, saved_stderr = os.dup(1), os.dup(2)
os.dup2(printed_file.fileno(), 1)
os.dup2(printed_file.fileno(), 2)
for name in sys.argv[2:]:
    if importlib.util.find_spec(name.split(".")[0]) is not None:
        __import__(name)
sys.stdout.flush()
sys.stderr.flush()
os.dup2(saved_stdout, 1)
os.dup2(saved_stderr, 2)
os.close(saved_stdout)
os.close(saved_stderr)
printed_file.seek(0)
printed = printed_file.read().decode(errors="replace")
printed_file.close()
# A thread (an OpenMP pool) would not survive the fork: torch must be imported, never used, here.
threads = len(os.listdir("/proc/self/task"))
# The imports' objects (~170,000) are out of the garbage collector's reach (gc.freeze, made for servers that
# fork): else each child's collections walk them all (0.1 s at exit) and copy the pages they touch. A child's own
# objects are collected as before.
import gc
gc.freeze()


def exit_status(exit):
    """The interpreter's exit status for SystemExit: None is 0, an int itself, anything else printed and 1."""
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code & 0xFF
    print(exit.code, file=sys.stderr)
    return 1


def finalize(status):
    """What Py_FinalizeEx does that a run can see: non-daemon threads joined, atexit, stdio flushed (else 120),
    the script's globals dropped (their files closed) and collected."""
    import gc, threading, atexit

    def flushed(status):  # a stream that can't be flushed makes the status 120, as Python's exit does
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                status = 120
        return status

    threading._shutdown()
    atexit._run_exitfuncs()
    status = flushed(status)
    sys.modules["__main__"].__dict__.clear()
    gc.collect()  # the globals' finalizers may print: flushed again
    return flushed(status)


def run_child(request):
    """In the forked child: become `python script args...` in cwd, with stdout and stderr into files."""
    status = 1
    try:
        os.environ.update(request.get("environ", {}))
        for fd, path, flags in [(0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                                (2, request["stderr"], os.O_WRONLY)]:
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[0:0] = [os.path.dirname(os.path.realpath(script))]
        if "numpy" in sys.modules:  # numpy's global generator is seeded at import: a fresh run draws a new seed
            sys.modules["numpy"].random.seed()
        import builtins, importlib.machinery
        main = sys.modules["__main__"].__dict__
        main.clear()
        main.update(__name__="__main__", __doc__=None, __package__=None, __spec__=None, __annotations__={},
                    __loader__=importlib.machinery.SourceFileLoader("__main__", script), __cached__=None,
                    __file__=os.path.join(os.getcwd(), script), __builtins__=builtins)
        try:
            with open(script, "rb") as f:
                source = f.read()
        except OSError as error:  # as the interpreter says it
            print(f"{sys.executable}: can't open file {script!r}: [Errno {error.errno}] {error.strerror}",
                  file=sys.stderr)
            os._exit(finalize(2))
        interrupted = False
        try:
            exec(compile(source, main["__file__"], "exec"), main)
            status = 0
        except SystemExit as exit:
            status = exit_status(exit)
        except BaseException as error:
            error.with_traceback(error.__traceback__.tb_next)  # this frame left out: the interpreter has none
            sys.excepthook(type(error), error, error.__traceback__)
            status = 1
            interrupted = isinstance(error, KeyboardInterrupt)
        status = finalize(status)
        if interrupted:  # the interpreter ends itself by SIGINT then, so that its parent sees how it ended
            import signal
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        os._exit(status)


os.write(1, (json.dumps({"printed": printed, "threads": threads}) + "\n").encode())
pending = b""
while True:
    while b"\n" not in pending:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            sys.exit(0)
        pending += chunk
    line, pending = pending.split(b"\n", 1)
    if line.startswith(b"wait "):
        _, status = os.waitpid(int(line.split()[1]), 0)
        os.write(1, f"{os.waitstatus_to_exitcode(status)}\n".encode())
        continue
    pid = os.fork()
    if pid == 0:
        run_child(json.loads(line))
    os.write(1, f"{pid}\n".encode())
'''
# Third-party only: the repo's modules (model.py) are imported by each script, fresh.
PREIMPORT = ["numpy", "torch", "torch.distributed", "torch.nn.parallel", "tiktoken", "regex", "tqdm",
             "safetensors.torch"]


class ScriptRunner:
    """start(command, cwd, env) and finish(run), or run(commands, cwd, env): [sys.executable, script, *args] as
    subprocess would run it, in a child forked from one warm server per environment; subprocess.CompletedProcess
    results, stdout and stderr as str (text=True) or bytes."""

    def __init__(self):
        self.servers = {}  # environment -> (server process, whether it can stand in for a fresh interpreter)

    def server(self, env):
        key = tuple(sorted(env.items()))
        if key not in self.servers:
            process = subprocess.Popen([sys.executable, "-c", "exec(__import__('sys').argv[1], {'__name__': "
                                        "'script_server'})", SERVER, *PREIMPORT], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env, cwd=REPO)
            ready = json.loads(process.stdout.readline())
            self.servers[key] = (process, ready["printed"] == "" and ready["threads"] == 1)
        return self.servers[key]

    def start(self, command, cwd, env=None, text=True, environ=None):
        """The run begun; finish(run) waits for it. environ: variables added in this run alone, for those that no
        import reads (a rank's RANK, MASTER_PORT): the server is env's."""
        assert command[0] == sys.executable and not command[1].startswith("-"), command
        env = dict(os.environ if env is None else env)
        # pytest names the running test in PYTEST_CURRENT_TEST: set in the run alone, else a server per test
        environ = {**{name: env.pop(name) for name in ["PYTEST_CURRENT_TEST"] if name in env}, **(environ or {})}
        server, faithful = self.server(env)
        if not faithful:  # the imports printed something or started a thread: a real process, then
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text,
                                       env=dict(env, **(environ or {})), cwd=cwd)
            return {"command": command, "process": process}
        outputs = tempfile.mkdtemp(prefix="script_runner_")
        run = {"command": command, "server": server, "env": env, "text": text, "outputs": outputs,
               "stdout": os.path.join(outputs, "stdout"), "stderr": os.path.join(outputs, "stderr")}
        open(run["stdout"], "w").close()
        open(run["stderr"], "w").close()
        request = {"argv": command[1:], "cwd": str(cwd), "stdout": run["stdout"], "stderr": run["stderr"],
                   "environ": environ or {}}
        run["pid"] = int(self.ask(run, json.dumps(request), time.time() + 60))
        return run

    def finish(self, run, timeout=180):
        if "process" in run:
            stdout, stderr = run["process"].communicate(timeout=timeout)
            return subprocess.CompletedProcess(run["command"], run["process"].returncode, stdout, stderr)
        try:
            returncode = int(self.ask(run, f"wait {run['pid']}", time.time() + timeout))
            stdout, stderr = (Path(run[name]).read_bytes() for name in ("stdout", "stderr"))
        finally:
            shutil.rmtree(run["outputs"])
        if run["text"]:  # as subprocess's text mode: the locale's encoding, newlines translated
            stdout, stderr = (b.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")
                              for b in (stdout, stderr))
        return subprocess.CompletedProcess(run["command"], returncode, stdout, stderr)

    def run(self, commands, cwd, env=None, text=True, timeout=180, parallel=os.cpu_count()):
        """Every command, `parallel` at a time; their results in order."""
        results, running = [], []
        try:
            for command in commands:
                if len(running) == parallel:
                    results.append(self.finish(running.pop(0), timeout))
                running.append(self.start(command, cwd, env, text))
            while running:
                results.append(self.finish(running.pop(0), timeout))
        except BaseException:  # the others too end with this one
            for run in running:
                if "pid" in run:
                    try:
                        os.kill(run["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    shutil.rmtree(run["outputs"])
            raise
        return results

    def ask(self, run, request, deadline):
        """Send a request, return the server's answer. A timeout, or an interrupted test, ends the child and
        the server (a later run starts another): no process stays, and no answer comes late."""
        server = run["server"]
        try:
            server.stdin.write(request.encode() + b"\n")
            server.stdin.flush()
            ready, _, _ = select.select([server.stdout], [], [], max(0.0, deadline - time.time()))
            if not ready:
                raise subprocess.TimeoutExpired(run["command"], deadline)
            answer = server.stdout.readline()
            assert answer, "the script runner's server died"
            return answer.decode().strip()
        except BaseException:
            if "pid" in run:
                try:
                    os.kill(run["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            server.kill()
            server.wait()
            self.servers.pop(tuple(sorted(run["env"].items())), None)
            raise

    def close(self):
        for server, _ in self.servers.values():
            server.stdin.close()
            server.wait(timeout=60)
        self.servers.clear()


# One per test session (per xdist worker), for fixtures and helpers alike; its servers end with the session.
SCRIPT_RUNNER = ScriptRunner()


@pytest.fixture(scope="session")
def script_runner():
    return SCRIPT_RUNNER


def pytest_sessionfinish(session):
    SCRIPT_RUNNER.close()
