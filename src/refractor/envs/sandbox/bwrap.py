"""The isolated local provider, built on bubblewrap (``apt-get install bubblewrap``).

Each command runs in fresh namespaces: no network (``--unshare-net``), its own PID namespace
(when the command ends, or bwrap is killed, every process it started dies with it), read-only
system directories (``/usr`` and the Python installation), a private writable workdir mounted
at ``/sandbox``, a size-limited private ``/tmp``, an empty environment, and per-process rlimits
(address space, CPU time, file size, open files, processes). Memory is also limited for the whole
process tree (see ``limits.py``).

Disk: ``/tmp`` is a tmpfs of ``disk_mb``. In ``root`` mode the workdir is a tmpfs of ``disk_mb`` too,
mounted on the host for the sandbox's lifetime (files persist from one command to the next and the
host reads them), so a write past the limit fails with ENOSPC while the program runs. In ``user``
mode no mount is possible on the host: each file is limited by ``RLIMIT_FSIZE`` and the workdir's
total is checked after each command (an overrun marks the sandbox unusable).

Two ways to drop privileges, probed once per process:
* ``root`` (running as root, e.g. in a container): bwrap sets up the mounts as root without a
  user namespace, then ``setpriv`` switches to a random unprivileged uid with no capabilities,
  so the program cannot read root-only files (``/etc/shadow``, ``/root``) or write anything
  but its workdir, and ``RLIMIT_NPROC`` counts only its own processes.
* ``user`` (an ordinary user): bwrap creates a user namespace; the program runs as that user
  and sees only what is bound into the sandbox.
If neither works, creating a sandbox raises ``SandboxUnavailableError`` with the reason.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from refractor.envs.sandbox.limits import MemoryLimitMode, detect_memory_mode
from refractor.envs.sandbox.local import LocalSandbox, rlimit_prefix
from refractor.envs.sandbox.protocol import SandboxConfig, SandboxError, SandboxUnavailableError

logger = logging.getLogger(__name__)

INSIDE_WORKDIR = "/sandbox"
_ETC_FILES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "localtime",
    "passwd",
    "group",
    "nsswitch.conf",
    "os-release",
    "mime.types",
)
_UID_RANGE = (200_000, 2_000_000_000)


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib32", "lib64", "sbin"):
        path = Path("/") / top
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    args += ["--perms", "0755", "--dir", "/etc"]
    for name in _ETC_FILES:
        if (Path("/etc") / name).exists():
            args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    return args


def _python_binds() -> list[str]:
    """The Python running refractor (and its venv) when it lives outside /usr.

    Applied after the private ``/tmp`` is mounted, so a venv under /tmp is not hidden by it.
    """
    args: list[str] = []
    for prefix in sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)}):
        if not prefix.startswith("/usr/"):
            # bwrap creates missing parents as 0700; the unprivileged uid must be able to traverse them
            for parent in reversed(Path(prefix).parents[:-1]):
                args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--ro-bind", prefix, prefix]
    return args


def _mount_workdir_tmpfs(sandbox: LocalSandbox) -> None:
    """A size-limited tmpfs over the host workdir, owned by the sandbox's uid."""
    size = sandbox.config.disk_mb * 1024 * 1024
    options = f"size={size},mode=0755,uid={sandbox.uid},gid={sandbox.uid},nosuid,nodev"
    run = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "refractor-sandbox", str(sandbox.host_workdir)],
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        shutil.rmtree(sandbox.root, ignore_errors=True)
        raise SandboxError(f"cannot mount the sandbox workdir tmpfs: {run.stderr.strip()}")
    sandbox.workdir_is_mount = True


class BwrapProvider:
    name = "bwrap"
    isolated = True

    def __init__(self, base_dir: str | None = None, extra_ro_binds: list[str] | None = None) -> None:
        self.base_dir = base_dir
        self.extra_ro_binds = list(extra_ro_binds or [])
        self._mode: str | None = None
        self._system = _system_binds()
        self._python_bin = os.path.dirname(os.path.realpath(sys.executable))

    # ----- availability ----------------------------------------------------------------------
    def modes_to_try(self) -> list[str]:
        modes = []
        if os.geteuid() == 0 and shutil.which("setpriv"):
            modes.append("root")
        modes.append("user")
        return modes

    def probe(self) -> str:
        """The privilege mode that works here (cached); raises SandboxUnavailableError."""
        if self._mode:
            return self._mode
        if shutil.which("bwrap") is None:
            raise SandboxUnavailableError(
                "bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap. "
                "To run untrusted code WITHOUT isolation anyway, use the 'unisolated' provider explicitly."
            )
        problems = []
        for mode in self.modes_to_try():
            root = Path(tempfile.mkdtemp(prefix="refractor-probe-", dir=self.base_dir))
            try:
                sandbox = self._new_sandbox(SandboxConfig(), root, mode)
                argv = self.build_argv(sandbox, [sys.executable, "-c", "print('ok')"], {}, mode)
                run = subprocess.run(argv, capture_output=True, text=True, timeout=30)
                if run.returncode == 0 and run.stdout.strip() == "ok":
                    self._mode = mode
                    logger.debug("bwrap sandbox mode: %s", mode)
                    return mode
                problems.append(f"{mode}: exit {run.returncode}: {run.stderr.strip()[:300]}")
            except (OSError, subprocess.TimeoutExpired) as err:
                problems.append(f"{mode}: {err}")
            finally:
                shutil.rmtree(root, ignore_errors=True)
        raise SandboxUnavailableError(
            "bubblewrap cannot create a sandbox here ("
            + "; ".join(problems)
            + "). In containers, allow user "
            "namespaces or run as root with CAP_SYS_ADMIN; or opt into the 'unisolated' provider explicitly."
        )

    @property
    def disk_limit_mode(self) -> str:
        """``tmpfs`` (the workdir's total is enforced while programs write) or ``rlimit`` (per file,
        total checked after each command)."""
        return "tmpfs" if self.probe() == "root" else "rlimit"

    @property
    def memory_limit_mode(self) -> MemoryLimitMode:
        return detect_memory_mode()[0]

    def available(self) -> bool:
        try:
            self.probe()
            return True
        except SandboxUnavailableError:
            return False

    # ----- sandboxes -------------------------------------------------------------------------
    def _new_sandbox(self, config: SandboxConfig, root: Path, mode: str) -> LocalSandbox:
        os.chmod(root, 0o700)  # nobody else on the host can reach the workdir
        uid = random.randint(*_UID_RANGE) if mode == "root" else None
        sandbox = LocalSandbox(self, config, root, INSIDE_WORKDIR, uid=uid)
        sandbox.host_workdir.mkdir()
        if uid is not None:
            os.chown(sandbox.host_workdir, uid, uid)
        os.chmod(sandbox.host_workdir, 0o755)
        return sandbox

    async def create(self, config: SandboxConfig) -> LocalSandbox:
        mode = self.probe()
        root = Path(tempfile.mkdtemp(prefix="refractor-sbx-", dir=self.base_dir))
        sandbox = self._new_sandbox(config, root, mode)
        if mode == "root":
            _mount_workdir_tmpfs(sandbox)
        return sandbox

    def wrap(
        self, sandbox: LocalSandbox, argv: list[str], env: dict[str, str]
    ) -> tuple[list[str], str | None]:
        return self.build_argv(sandbox, argv, env, self.probe()), None

    def build_argv(self, sandbox: LocalSandbox, argv: list[str], env: dict[str, str], mode: str) -> list[str]:
        config = sandbox.config
        cmd = [
            "bwrap",
            "--die-with-parent",
            "--new-session",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--hostname",
            "sandbox",
        ]
        if not config.network:
            cmd.append("--unshare-net")
        if mode == "user":
            cmd.append("--unshare-user")
        else:
            cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        cmd += self._system
        for path in self.extra_ro_binds:
            cmd += ["--ro-bind", path, path]
        cmd += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--perms",
            "1777",
            "--size",
            str(config.disk_mb * 1024 * 1024),
            "--tmpfs",
            "/tmp",
            "--bind",
            str(sandbox.host_workdir),
            INSIDE_WORKDIR,
            "--chdir",
            INSIDE_WORKDIR,
            *_python_binds(),
            "--remount-ro",
            "/",
            "--clearenv",
        ]  # the sandbox's own root: no writable scratch outside /tmp
        path = f"{self._python_bin}:/usr/local/bin:/usr/bin:/bin"
        for key, value in {
            "PATH": path,
            "HOME": INSIDE_WORKDIR,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            **env,
        }.items():
            cmd += ["--setenv", key, value]
        cmd.append("--")
        if mode == "root":
            cmd += [
                "setpriv",
                f"--reuid={sandbox.uid}",
                f"--regid={sandbox.uid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
            ]
        return [*cmd, *rlimit_prefix(config), *argv]
