"""Every launchd job the nix-darwin module generates passes ``--check`` through the real CLI.

The module is evaluated in real nix-darwin (tests/darwin-eval.nix, `commands`: each example
host's agent and daemon ProgramArguments, the policy text and the token path). Each job's
``/bin/sh -c "/bin/wait4path /nix/store && exec …"`` line is split as the shell would, the
store path of ``plimsoll`` becomes this environment's ``plimsoll``, the files it names
(/etc/plimsoll/policy.json, the admin token) are created in a temporary directory, and the
command runs with ``--check``: a daemon that could not start fails here, not in a Mac's
launchd log. studio and studio-b are a two-host cluster: both hosts' agents carry the ranks.

Needs Nix (nix-instantiate) and local snapshots of nix-darwin and nixpkgs' lib, named by
NIX_DARWIN_SRC and NIXPKGS_LIB (as tests/nix/run.sh takes them); skipped without them.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DARWIN = os.environ.get("NIX_DARWIN_SRC", "")
NIXLIB = os.environ.get("NIXPKGS_LIB", "")
WRAP = "/bin/wait4path /nix/store && exec "

pytestmark = pytest.mark.skipif(
    not (shutil.which("nix-instantiate") and Path(DARWIN, "eval-config.nix").is_file()
         and Path(NIXLIB, "lib/default.nix").is_file()),
    reason="needs nix-instantiate and NIX_DARWIN_SRC / NIXPKGS_LIB naming local snapshots of "
           "nix-darwin and nixpkgs' lib (see tests/nix/run.sh)")


@pytest.fixture(scope="module")
def commands() -> dict:
    env = {**os.environ, "NIX_CONFIG": "experimental-features = nix-command flakes\n"
           "substituters =\nbuild-users-group =\nsandbox = false"}
    done = subprocess.run(
        ["nix-instantiate", "--eval", "--strict", "--json", str(REPO / "tests/darwin-eval.nix"),
         "--arg", "nixDarwinSrc", DARWIN, "--arg", "nixpkgsLib", NIXLIB, "-A", "commands"],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def our_plimsoll() -> list[str]:
    script = Path(sys.executable).with_name("plimsoll")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "plimsoll.cli"]


def argv_of(program_arguments: list[str], host: dict) -> list[str]:
    """What launchd runs, as the shell splits it, with the store binary named as generated."""
    sh, dash_c, line = program_arguments
    assert (sh, dash_c) == ("/bin/sh", "-c") and line.startswith(WRAP), program_arguments
    argv = shlex.split(line.removeprefix(WRAP))
    assert argv[0] == host["plimsoll"], argv
    return argv


def materialise(argv: list[str], host: dict, tmp: Path, token: bool = True) -> list[str]:
    """The command with our plimsoll and its named files in ``tmp``; any other absolute path
    it names is a failure (a new file the module names must be created here too)."""
    tmp.mkdir(parents=True, exist_ok=True)
    files = {"/etc/plimsoll/policy.json": tmp / "policy.json",
             host["adminTokenFile"]: tmp / "admin-token"}
    files["/etc/plimsoll/policy.json"].write_text(host["policy"])
    if token:
        files[host["adminTokenFile"]].write_text("0123456789abcdef" * 4 + "\n")
        files[host["adminTokenFile"]].chmod(0o400)  # as the activation leaves it
    out = []
    for arg in argv[1:]:
        if arg.startswith("/"):
            assert arg in files, f"the module names a file this test does not create: {arg}"
            arg = str(files[arg])
        out.append(arg)
    return our_plimsoll() + out


def run_check(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*argv, "--check"], capture_output=True, text=True, timeout=120)


def jobs(commands: dict):
    for name, host in sorted(commands.items()):
        for job, args in sorted(host["jobs"].items()):
            yield name, job, host, args


def test_every_host_has_an_agent_and_a_daemon(commands):
    assert set(commands) >= {"studio", "studio-b", "macbook"}
    for host in commands.values():
        assert set(host["jobs"]) == {"agent:plimsoll-serve", "daemon:plimsoll-watch-link"}


def test_every_generated_job_passes_check(commands, tmp_path):
    ran = []
    for name, job, host, args in jobs(commands):
        tmp = tmp_path / name / job.replace(":", "-")
        done = run_check(materialise(argv_of(args, host), host, tmp))
        assert done.returncode == 0, f"{name} {job}:\n{done.stdout}{done.stderr}"
        assert "check passed" in done.stdout and "ok   policy" in done.stdout
        assert "ok   admin token file" in done.stdout  # both read the one shared token
        ran.append((name, job))
    assert len(ran) == 2 * len(commands)


def test_the_two_cluster_members_carry_each_others_ranks(commands, tmp_path):
    seen = {}
    for name in ("studio", "studio-b"):
        host = commands[name]
        argv = argv_of(host["jobs"]["agent:plimsoll-serve"], host)
        ranks = [argv[i + 1] for i, a in enumerate(argv) if a == "--cluster-rank"]
        seen[name] = ranks
        done = run_check(materialise(argv, host, tmp_path / name))
        assert done.returncode == 0, done.stdout
        assert "ok   2 cluster ranks" in done.stdout
        assert argv[argv.index("--cluster-backend") + 1] == "ring"  # as both hosts declare
        assert "ok   cluster backend ring" in done.stdout
    # each host is its own rank 0; the figures agree across the cluster
    assert seen == {"studio": ["80:96:80", "52:64:52"], "studio-b": ["52:64:52", "80:96:80"]}


def test_check_catches_a_job_that_cannot_start(commands, tmp_path):
    host = commands["studio"]
    daemon = argv_of(host["jobs"]["daemon:plimsoll-watch-link"], host)
    # the token file absent (activation did not run): the daemon would exit at every start
    done = run_check(materialise(daemon, host, tmp_path, token=False))
    assert done.returncode == 2 and "admin token file" in done.stdout
    # the command line this module generated before it shared a token
    old = [a for a in materialise(daemon, host, tmp_path)
           if a not in ("--admin-token-file", str(tmp_path / "admin-token"))]
    done = run_check(old)
    assert done.returncode == 2 and "--admin-token-file is required" in done.stdout


def test_the_activation_creates_the_token_once(commands, tmp_path):
    """The generated activation snippet, run by bash as nix-darwin's activate runs it. The
    macOS-only steps (chown to root:wheel, chmod -N / +a for the ACL) go to a logging shim:
    what is checked for real is the token's creation, its mode, and that it is kept."""
    host = commands["studio"]
    token = tmp_path / "db" / "plimsoll" / "admin-token"
    script = host["activation"].replace(host["adminTokenFile"], str(token))
    shim, log = tmp_path / "bin", tmp_path / "macos-only.log"
    shim.mkdir()
    for cmd, real in (("chown", None), ("chmod", shutil.which("chmod"))):
        passthrough = f'exec {real} "$@"' if real else "exit 0"
        (shim / cmd).write_text(
            "#!/bin/sh\n"
            f'case "$1" in +a|-N|root:wheel) echo "{cmd} $*" >>{log}; exit 0;; esac\n'
            f"{passthrough}\n")
        (shim / cmd).chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}

    def activate() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env,
                              capture_output=True, text=True, timeout=30)

    first = activate()
    assert first.returncode == 0, first.stderr
    assert "creating the admin token" in first.stderr
    text = token.read_text()
    assert len(text) == 64 and int(text, 16) >= 0  # 32 random bytes, hex, no newline
    assert (token.stat().st_mode & 0o777) == 0o400
    assert log.read_text().splitlines() == [
        f"chown root:wheel {token}", f"chmod -N {token}", f"chmod +a user:alice allow read {token}"]

    again = activate()  # a later switch keeps the token (both services hold it)
    assert again.returncode == 0 and "creating" not in again.stderr
    assert token.read_text() == text

    token.chmod(0o600)
    token.write_text("")  # an empty token is replaced
    assert activate().returncode == 0 and len(token.read_text()) == 64


def test_both_members_carry_the_backend_and_check_refuses_one_missing_here(tmp_path):
    """Every cluster member declaring nccl (``backendCommands``): both generated agent
    commands name it before their ranks, and each, run with --check on a host whose MLX
    has no CUDA, is refused with the reason; on ring both pass."""
    from plimsoll.cluster.backend import read_availability

    if read_availability().usable("nccl"):
        pytest.skip("this host has CUDA: nccl is available here")
    env = {**os.environ, "NIX_CONFIG": "experimental-features = nix-command flakes\n"
           "substituters =\nbuild-users-group =\nsandbox = false"}
    done = subprocess.run(
        ["nix-instantiate", "--eval", "--strict", "--json", str(REPO / "tests/darwin-eval.nix"),
         "--arg", "nixDarwinSrc", DARWIN, "--arg", "nixpkgsLib", NIXLIB, "-A",
         "backendCommands"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    both = json.loads(done.stdout)
    for backend, code in (("nccl", 2), ("ring", 0)):
        for name in ("studio", "studio-b"):
            host = both[backend][name]
            argv = argv_of(host["jobs"]["agent:plimsoll-serve"], host)
            at = argv.index("--cluster-backend")
            assert argv[at + 1] == backend and argv[at + 2] == "--cluster-rank"
            checked = run_check(materialise(argv, host, tmp_path / backend / name))
            assert checked.returncode == code, checked.stdout
            assert ("--cluster-backend is 'nccl' but MLX here is not its CUDA build"
                    if backend == "nccl" else
                    "ok   cluster backend ring (named by --cluster-backend, available here"
                    ) in checked.stdout
