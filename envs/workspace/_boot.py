"""Bootstrap of every sandboxed process. Runs in the child, never imported by the host.

The sandbox starts ``<python> -I -S -c <this file's source> key=value... -- payload...``
(``action=python|exec|kill``, ``uid=``, ``gid=``, ``parent=``, ``guard=0|1``, ``site=0|1``,
``limits=cpu:soft:hard,as:soft:hard,...``; the payload is the code, or the argv to exec).
No json import: the configuration is parsed by hand to keep start-up fast. This code
then, before any untrusted code runs:

1. sets hard resource limits (``setrlimit``: CPU, address space, file size, processes,
   open files, core dumps);
2. drops to the sandbox's unprivileged uid/gid when started as root (and checks that
   root cannot be regained), so ``RLIMIT_NPROC`` applies and root-only files stay shut;
3. in rlimit mode, forks once: the parent stays as a "guard" (a child subreaper that
   reaps every orphan and, with a private uid, kills all the uid's other processes when
   the code ends, when the host asks with SIGTERM, or when the host dies -- via
   ``PR_SET_PDEATHSIG``), and the code's parent is the guard, not the host
   (``os.kill(os.getppid(), 9)`` cannot reach the host);
4. runs the code in ``__main__`` (``action="python"``), ``execvp``s a command
   (``action="exec"``), or kills every process of the uid (``action="kill"``).

Standard library only, and syntax valid on Python 3.8+, because it runs under whichever
interpreter the sandbox uses (a system ``python3`` in rlimit mode as root).
"""

import _signal as signal  # the C module: no enum import, a few ms faster to start
import os
import resource
import sys


def _parse(argv):
    split = argv.index("--")
    cfg = dict(arg.partition("=")[::2] for arg in argv[:split])
    return cfg, argv[split + 1 :]


def _set_limits(spec):
    for item in filter(None, spec.split(",")):
        name, soft, hard = item.split(":")
        resource.setrlimit(getattr(resource, "RLIMIT_" + name.upper()), (int(soft), int(hard)))


def _drop_privileges(uid, gid):
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        os._exit(125)
    try:
        os.setuid(0)
    except PermissionError:
        return
    os._exit(125)  # root could be regained: refuse to run anything


def _prctl(option, value):
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _die_with(parent, sig):
    _prctl(1, int(sig))  # PR_SET_PDEATHSIG: get `sig` when the parent dies
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _guard(host, sweep):
    """Fork; the child runs the code while this process stays as its parent and reaper.

    As a child subreaper it adopts every orphan the code leaves and reaps it, so no
    zombie keeps counting against ``RLIMIT_NPROC``. With ``sweep`` (running as the
    sandbox's private uid) it kills every other process of the uid when the code's main
    process exits, on SIGTERM from the host, and when the host dies, then reaps them all.
    """

    def sweep_all(*_):
        try:
            os.kill(-1, signal.SIGKILL)  # every process of this uid but ourselves
        except OSError:
            pass

    if sweep:
        signal.signal(signal.SIGTERM, sweep_all)
    if host:
        _die_with(host, signal.SIGTERM if sweep else signal.SIGKILL)
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    guard = os.getpid()
    pid = os.fork()
    if pid == 0:
        if sweep:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with(guard, signal.SIGKILL)
        return
    status = 0
    while True:
        try:
            child, code = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if child == pid:
            status = code
            if not sweep:
                break
            sweep_all()
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def _run_python(code, site_packages):
    if site_packages:
        import site

        site.main()
    if sys.path[:1] != [""]:
        sys.path.insert(0, "")  # import the workspace's modules (-I leaves cwd out)
    sys.argv = ["-c"]
    sys.dont_write_bytecode = True  # no __pycache__ folders in the workspace
    exc_info, exit_, stdout = sys.exc_info, sys.exit, sys.stdout
    namespace = sys.modules["__main__"].__dict__  # the code runs as the real __main__
    for name in list(namespace):
        if name not in ("__name__", "__builtins__"):
            del namespace[name]
    namespace.update(__doc__=None, __spec__=None, __loader__=None, __package__=None)
    try:
        exec(compile(code, "<code>", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException:
        etype, value, tb = exc_info()
        if issubclass(etype, MemoryError):
            namespace.clear()  # free what the code allocated, so the report can be printed
        try:
            stdout.flush()
        except Exception:
            pass
        import linecache
        import traceback

        linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
        traceback.print_exception(etype, value, tb.tb_next)
        exit_(1)


def main():
    cfg, payload = _parse(sys.argv[1:])
    uid = int(cfg["uid"]) if cfg.get("uid") else None
    gid = int(cfg["gid"]) if cfg.get("gid") else uid
    if cfg["action"] == "kill":
        _drop_privileges(uid, gid)
        try:
            os.kill(-1, signal.SIGKILL)  # every process of this uid but ourselves
        except OSError:
            pass
        os._exit(0)
    _set_limits(cfg.get("limits", ""))
    if uid is not None:
        _drop_privileges(uid, gid)
    host = int(cfg["parent"]) if cfg.get("parent") else 0
    os.umask(0o022)
    if cfg.get("guard") == "1":
        _guard(host, sweep=uid is not None)
    elif host:
        _die_with(host, signal.SIGKILL)
    if cfg["action"] == "exec":
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        try:
            os.execvp(payload[0], payload)
        except OSError as exc:
            sys.stderr.write("cannot run " + payload[0] + ": " + str(exc.strerror) + "\n")
            os._exit(127)
    _run_python(payload[0], cfg.get("site") == "1")


main()
