"""The Workspace environment (``agentenv/Workspace-v0``): file tasks in a sandboxed folder."""

from __future__ import annotations

from typing import Any

from agentenv.env.core import Task, ToolEnv
from agentenv.env.parsers import ActionParser
from agentenv.env.spaces import Message
from agentenv.env.tools import Tool, tool
from agentenv.errors import InvalidOptionError
from envs.workspace.errors import SandboxError
from envs.workspace.paths import FileLimits
from envs.workspace.sandbox import RunResult, SandboxLimits, detect_backend
from envs.workspace.tasks import as_actions, check_task, load_tasks, solve_task
from envs.workspace.workspace import Workspace

_ERROR_TAIL = 200  # characters of output quoted in a "stopped by the sandbox" error


def describe_run(result: RunResult, what: str) -> str:
    """The observation for a finished run: its output, plus ``[exit code N]`` if not 0.

    Raises:
        SandboxError: the sandbox stopped the run (time limit, quota, a limit's signal).
    """
    if result.stopped or result.signal:
        tail = result.output[-_ERROR_TAIL:].strip()
        shown = f" Its last output: {tail!r}" if tail else ""
        raise SandboxError(f"{what} was {result.detail}.{shown}")
    text = result.output if result.output.strip() else "(no output)"
    if result.exit_code:
        text = f"{text.rstrip()}\n[exit code {result.exit_code}]"
    return text


class WorkspaceEnv(ToolEnv):
    """File tasks in a fresh sandboxed folder per episode (id ``agentenv/Workspace-v0``).

    Each ``reset`` creates a private temporary directory with the task's files; the
    agent works in it with ``list_files``, ``read_file``, ``write_file``, ``run_python``
    and (unless ``shell=False``) ``run``, then ends with ``<answer>...</answer>``. The
    answer text is not graded: the task's checker inspects the final state of the
    workspace. Code runs in the sandbox of :mod:`envs.workspace.sandbox` (``bwrap`` when
    available, else ``rlimit``; ``info["sandbox"]`` says which). ``close()``, the next
    ``reset`` and garbage collection kill anything still running and delete the folder.

    Reward: 1.0 when every check passes, else 0.0; with ``partial_credit=True`` the share
    of checks passed. ``info`` at the end carries ``correct``, ``checks_failed`` (the
    failed checks, by description), ``checks_passed`` / ``checks_total`` and ``sandbox``.
    An episode that ends by ``max_turns`` (truncated) scores 0, like every ToolEnv.

    Args:
        split: ``"train"`` or ``"test"`` (disjoint).
        families: Task families to draw from (default all: files, data, bugfix, rename).
        levels: ``("easy", "hard")`` or a subset.
        num_tasks: Tasks in the split (default 800 train / 200 test).
        data_seed: Seed of the task generator.
        sandbox: ``"auto"`` (bwrap if usable, else rlimit with a warning), ``"bwrap"`` or
            ``"rlimit"``.
        limits: Limits of each code run (default 10 s wall clock, 1 GiB, 32 processes).
        file_limits: Caps on file sizes and counts.
        shell: Offer the ``run`` (shell command) tool besides ``run_python``.
        site_packages: Let sandboxed Python import installed packages (default: stdlib).
        partial_credit: Reward the share of checks passed instead of all-or-nothing.
        max_turns: Actions per episode before ``truncated``.
        parser: Action parser (default Hermes ``<tool_call>`` / ``<answer>``).
        max_output_chars: Longest tool output shown to the model (head and tail kept).
        prompt_style: ``"full"`` (instructions plus every tool's JSON schema, ~690
            tokens) or ``"compact"`` (one harmless example call, ``list_files``, and the
            tools' signatures, ~125 tokens; for small models and CPU training).
        render_mode: ``None`` or ``"ansi"``.
    """

    def __init__(
        self,
        *,
        split: str = "train",
        families: tuple[str, ...] | list[str] | None = None,
        levels: tuple[str, ...] | list[str] | None = None,
        num_tasks: int | None = None,
        data_seed: int = 0,
        sandbox: str = "auto",
        limits: SandboxLimits | None = None,
        file_limits: FileLimits | None = None,
        shell: bool = True,
        site_packages: bool = False,
        partial_credit: bool = False,
        max_turns: int = 20,
        parser: ActionParser | None = None,
        max_output_chars: int = 4000,
        prompt_style: str = "full",
        render_mode: str | None = None,
    ):
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise InvalidOptionError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        if file_limits is not None and not isinstance(file_limits, FileLimits):
            raise InvalidOptionError(
                f"file_limits must be a FileLimits, got {type(file_limits).__name__}"
            )
        self.limits = limits or SandboxLimits()
        self.file_limits = file_limits or FileLimits()
        self.backend = detect_backend(sandbox)
        self.site_packages = bool(site_packages)
        self.partial_credit = bool(partial_credit)
        self._tasks = load_tasks(
            split, num_tasks=num_tasks, families=families, levels=levels, seed=data_seed
        )
        self.workspace: Workspace | None = None
        super().__init__(
            self._make_tools(shell),
            split=split,
            parser=parser,
            max_turns=max_turns,
            # the sandbox enforces its own limit; the executor's is a backstop after it
            tool_timeout_s=self.limits.timeout_s + 15.0,
            max_output_chars=max_output_chars,
            prompt_style=prompt_style,
            render_mode=render_mode,
        )

    @property
    def sandbox_mode(self) -> str:
        """``"bwrap"`` or ``"rlimit"``: how code is isolated on this machine."""
        return self.backend.mode

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    def get_task(self, index: int) -> Task:
        return self._tasks[index]

    def demonstration(self, task: Task) -> list[str] | None:
        """The family's scripted solver as actions: its tool calls, then ``<answer>``.

        The solver reads the task's parameters and starting files (what the task states),
        and the replay keeps a demonstration only if the checker passes it.
        """
        return as_actions(solve_task(task))

    def instructions(self) -> str:
        return (
            "You work in a private folder (the workspace) using tools. Paths are relative to "
            "the workspace root. Code run with run_python"
            + (" or run" if any(t.name == "run" for t in self.tools) else "")
            + f" is sandboxed: {self.limits.timeout_s:g} s time limit, no background "
            "processes after a call, Python standard library only"
            + (" plus installed packages" if self.site_packages else "")
            + ". When the task is done, reply with <answer>done</answer>: your work is "
            "checked from the files in the workspace, not from the answer text."
        )

    def compact_prompt(self) -> str:
        signatures = ", ".join(
            f"{t.name}({', '.join(t.parameters['properties'])})" for t in self.tools
        )
        return (
            "Do the task in your workspace folder with tools. Call one like this:\n"
            '<tool_call>{"name": "list_files", "arguments": {"path": "."}}</tool_call>\n'
            f"Tools: {signatures}. Code runs sandboxed ({self.limits.timeout_s:g} s, Python "
            "standard library"
            + (" plus installed packages" if self.site_packages else "")
            + "). When the task is done, reply with <answer>done</answer>: the files are "
            "checked, not the answer."
        )

    def on_reset(self, task: Task) -> None:
        self._close_workspace()
        self.workspace = Workspace(
            task.metadata["files"],
            backend=self.backend,
            limits=self.limits,
            file_limits=self.file_limits,
            site_packages=self.site_packages,
        )

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        return obs, {**info, "sandbox": self.sandbox_mode}

    def score(self, answer: str, task: Task) -> tuple[float, dict[str, Any]]:
        if self.workspace is None or self.workspace.closed:  # close() came before the answer
            return 0.0, {
                "correct": False,
                "checks_failed": ["the workspace was closed before the answer"],
                "checks_passed": 0,
                "checks_total": 0,
                "sandbox": self.sandbox_mode,
            }
        result = check_task(task, self.workspace)
        reward = result.fraction if self.partial_credit else float(result.passed)
        return reward, {
            "correct": result.passed,
            "checks_failed": result.failed,
            "checks_passed": len(result.checks) - len(result.failed),
            "checks_total": len(result.checks),
            "sandbox": self.sandbox_mode,
        }

    def close(self) -> None:
        self._close_workspace()
        super().close()

    def _close_workspace(self) -> None:
        if self.workspace is not None:
            self.workspace.close()
            self.workspace = None

    def _ws(self) -> Workspace:
        if self.workspace is None or self.workspace.closed:
            raise SandboxError("there is no open workspace; call reset() first")
        return self.workspace

    def _make_tools(self, shell: bool) -> list[Tool]:
        """The tools, as closures bound to this instance's current workspace."""
        timeout = f"{self.limits.timeout_s:g}"

        def list_files(path: str = ".") -> str:
            """List the files and folders under a folder of the workspace, recursively.

            Args:
                path: Folder relative to the workspace root; "." is the root.
            """
            return self._ws().list_files(path)

        def read_file(path: str, start_line: int | None = None, end_line: int | None = None) -> str:
            """Read a text file of the workspace, or only some of its lines.

            Args:
                path: File path relative to the workspace root, e.g. "data/sales.csv".
                start_line: First line to return (1-based); default the first line.
                end_line: Last line to return (inclusive); default the last line.
            """
            return self._ws().read_file(path, start_line, end_line)

        def write_file(path: str, content: str) -> str:
            """Create or overwrite a text file in the workspace (folders are created).

            Args:
                path: File path relative to the workspace root, e.g. "notes/todo.txt".
                content: The complete new content of the file.
            """
            return self._ws().write_file(path, content)

        def run_python(code: str) -> str:
            """Run Python code in the workspace folder and return its output.

            Args:
                code: A complete Python program; print what you want to see.
            """
            return describe_run(self._ws().run_python(code), "the code")

        def run(command: str) -> str:
            """Run a shell command (sh) in the workspace folder and return its output.

            Args:
                command: The command line, e.g. "ls -l" or "python -m unittest".
            """
            return describe_run(self._ws().run_shell(command), "the command")

        for fn in (run_python, run):
            assert fn.__doc__ is not None
            fn.__doc__ = fn.__doc__.replace(
                "return its output.",
                f"return its output (stdout and stderr). Limit: {timeout} s; processes it "
                "starts are stopped when it returns.",
            )
        fns = [list_files, read_file, write_file, run_python] + ([run] if shell else [])
        return [tool(fn) for fn in fns]
