"""run_cli: runs the real ``hugeembed`` command in a process of its own (this tree's package on PYTHONPATH).

A process is forked from a zygote that imported torch and hugeembed once and never ran a torch op
(multiprocessing's forkserver): the command runs as ``python -m hugeembed`` does (its own process, its
exit status, its stdout and stderr) without paying ~3.5 s of interpreter and torch start-up per call.
``HUGEEMBED_TEST_CLI_SUBPROCESS=1`` (or arguments beyond ``cwd``) runs a fresh interpreter instead.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_CTX = None


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run_cli(*args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    argv = [str(a) for a in args]
    if os.environ.get("HUGEEMBED_TEST_CLI_SUBPROCESS") == "1" or set(kw) - {"cwd"}:
        return subprocess.run([sys.executable, "-m", "hugeembed", *argv], capture_output=True, text=True,
                              env=_env(), timeout=timeout, **kw)
    return _forked(argv, kw.get("cwd"), timeout)


def _context():
    global _CTX
    if _CTX is None:
        os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]  # the zygote imports this tree's package
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "hugeembed.cli"])
    return _CTX


def _forked(argv: list[str], cwd, timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="hugeembed-cli-") as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        p = _context().Process(target=_command, args=(argv, None if cwd is None else str(cwd), out, err, _env()))
        p.start()
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(["hugeembed", *argv], timeout)
        read = lambda path: Path(path).read_text(errors="replace") if os.path.exists(path) else ""  # noqa: E731
        return subprocess.CompletedProcess(["hugeembed", *argv], p.exitcode, read(out), read(err))


def _command(argv: list[str], cwd: str | None, out: str, err: str, env: dict[str, str]) -> None:
    """In the forked process: ``python -m hugeembed ARGV`` with stdout / stderr into the files, under the
    caller's environment now (a variable read when torch or hugeembed is imported keeps the zygote's)."""
    import traceback

    os.environ.clear()
    os.environ.update(env)

    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    code = 1
    try:
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = [os.path.join(str(ROOT), "hugeembed", "__main__.py"), *argv]
        from hugeembed.cli import main

        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        import atexit

        try:  # as an interpreter's exit: atexit handlers and weakref finalizers (tiers remove their files)
            atexit._run_exitfuncs()
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 2, exactly one line on stderr containing every fragment, no traceback."""
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("hugeembed"), err
    for f in fragments:
        assert f in err, (f, err)
    return err
