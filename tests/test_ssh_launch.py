"""MXNet's ssh launcher across hosts, each host a network namespace running its own sshd.

The multi-host command the README documents, run here as written::

    python <site-packages>/mxnet/tools/launch.py --launcher ssh -H hostfile -n 2 -s 2 \\
        MXPS_SECRET_FILE=/path/to/job.secret python train.py

How the secret gets to the hosts: dmlc_tracker/ssh.py runs, through a shell,
``ssh -o StrictHostKeyChecking=no HOST -p PORT '<exports>; cd <cwd>; <command>'`` where the
exports are the DMLC_* variables it makes plus a fixed list (OMP_NUM_THREADS, KMP_AFFINITY,
LD_LIBRARY_PATH, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, DMLC_INTERFACE); launch.py's
``--env`` is read by dmlc's yarn launcher only and never reaches an ssh host (checked below).
So the command carries ``MXPS_SECRET_FILE=<path>``, as launch.py's own ``--p3`` carries
``DMLC_PS_VAN_TYPE=p3``: a path, so the secret itself is on no command line (``MXPS_SECRET=``
there would be readable in every host's process list). The file must exist at that path on
every host and on the launching machine, where dmlc's tracker runs the scheduler. (launch.py's
``--env-server``/``--env-worker`` are worse: dmlc's parser does not know them, so they end up
inside the command. And launch.py exits 0 whatever the nodes do: dmlc's threads only print a
failed node's CalledProcessError; the nodes' own messages come through ssh to its output.)

Layout (mxps_tools.emunet): node ``launcher`` runs launch.py, hence the scheduler; nodes
``h0..h2`` each run an sshd bound to their own 198.18 address (temp host key; root admitted
with one temp client key only; no password, no PAM; config, keys and authorized_keys under the
test's temp dir: /etc/ssh and /root/.ssh are never read or written; only sshd's compiled-in
privilege separation directory /run/sshd is made if missing, and removed). MXNet's ``ssh`` is a
wrapper first on PATH that adds ``-F <temp config>``. Every node sees its own copy of the
secret directory (a bind mount in its own mount namespace, emunet ``binds``), as separate
machines do, so "hosts disagreeing on the secret" is one host whose copy differs.

dmlc places process i (servers first) on hosts[i % len(hosts)]: s0 on h0, s1 on h1, w0 on h2,
w1 on h0. Needs root, iproute2 and openssh-server (scripts/test-deps.sh installs it).
"""
import dataclasses
import json
import glob
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster  # noqa: E402
from mxps_tools import cli, emunet, patching  # noqa: E402

HOSTS = ["h0", "h1", "h2"]
NODES = ["launcher"] + HOSTS
#: Host whose copy of the secret differs in the disagreeing job (it runs s0 and w1).
ODD_HOST = "h0"
NAMESPACE_NET = ipaddress.ip_network("198.18.0.0/15")
SSH_PORT = 22
JOB_TIMEOUT = 240
#: The disagreeing job ends when the scheduler's start timeout does.
MISMATCH_START_TIMEOUT = 20
MISMATCH_TIMEOUT = MISMATCH_START_TIMEOUT + 90
#: After launch.py exits, its ssh clients and the hosts' job processes get this long to end.
LINGER_SECONDS = 30
#: Set in launch.py's environment and named with --env: never reaches an ssh host.
PROBE = "SSH_LAUNCH_ENV_PROBE"
#: The job's settings the hosts need, beyond what dmlc exports: on the command line.
FORWARDED = {k: v for k, v in cluster.QUIET_ENV.items()
             if k not in ("OMP_NUM_THREADS", "KMP_AFFINITY")}
SHELL_SAFE = re.compile(r"^[A-Za-z0-9_./:,=+@%-]*$")
PRIVSEP_DIR = "/run/sshd"

RECORDER = '''\
"""Record how this node was started (tests/test_ssh_launch.py), then run train_job.py."""
import hashlib, json, os, runpy, sys

train_job = sys.argv[1]
out = os.environ["JOB_OUT"]
os.makedirs(out, exist_ok=True)
role = os.environ.get("DMLC_ROLE", "worker")
secret_file = os.environ.get("MXPS_SECRET_FILE", "")
try:
    with open(secret_file, "rb") as f:
        digest = hashlib.sha256(f.read().strip()).hexdigest()
except OSError as exc:
    digest = "unreadable: %s" % exc
record = {"role": role, "dmlc": {k: v for k, v in os.environ.items() if k.startswith("DMLC_")},
          "ssh_connection": os.environ.get("SSH_CONNECTION"), "secret_file": secret_file,
          "secret_sha256": digest, "probe": os.environ.get("@PROBE@"),
          "mxps_secret_set": "MXPS_SECRET" in os.environ}
path = os.path.join(out, "node_%s_%d.json" % (role, os.getpid()))
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
sys.argv = [train_job]
runpy.run_path(train_job, run_name="__main__")
'''.replace("@PROBE@", PROBE)


def _find_sshd():
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return shutil.which("sshd", path=path)


# hosts are network namespaces, each with its own sshd: the netns tier (root; tests/conftest.py)


# --------------------------------------------------------------------------- the hosts

@dataclasses.dataclass
class SshHosts:
    """The running topology and everything the launcher needs to reach its hosts."""
    topo: emunet.Topology
    base: str
    hostfile: str
    bin_dir: str               # holds the ``ssh`` wrapper
    client_config: str
    secret_dir: str            # the path every node sees its own copy of the secrets at
    private_dirs: Dict[str, str]
    sshd: Dict[str, subprocess.Popen]
    sshd_logs: Dict[str, str]

    def secret_file(self, name):
        return os.path.join(self.secret_dir, name)

    def sshd_log_tails(self, chars=1500):
        tails = []
        for host, path in self.sshd_logs.items():
            with open(path, errors="replace") as f:
                tails.append("--- sshd on %s:\n%s" % (host, f.read()[-chars:]))
        return "\n".join(tails)


def _keygen(path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "mxps-test",
                    "-f", path], check=True, stdin=subprocess.DEVNULL, timeout=30)


def _write(path, text, mode=0o600):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _read(path):
    with open(path) as f:
        return f.read()


def _sshd_config(addr, host_key, authorized_keys):
    """Root by public key (the one in ``authorized_keys``) only; nothing else offered."""
    return "\n".join([
        "ListenAddress %s:%d" % (addr, SSH_PORT),
        "HostKey %s" % host_key,
        "PidFile none",
        "AuthorizedKeysFile %s" % authorized_keys,
        "AuthenticationMethods publickey",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "HostbasedAuthentication no",
        "PermitRootLogin prohibit-password",
        "AllowUsers root",
        "UsePAM no",
        # the temp dir lies under /tmp (mode 1777), which StrictModes refuses for key files;
        # the directory itself is root's, mode 0700
        "StrictModes no",
        "PermitUserEnvironment no",
        "DisableForwarding yes",
        "PermitTTY no",
        "PrintMotd no",
        "UseDNS no",
        "MaxStartups 64",
        "LogLevel INFO",
        "",
    ])


def _client_config(key, known_hosts):
    return "\n".join([
        "Host *",
        "  User root",
        "  IdentityFile %s" % key,
        "  IdentitiesOnly yes",
        "  PasswordAuthentication no",
        "  KbdInteractiveAuthentication no",
        "  UserKnownHostsFile %s" % known_hosts,
        "  GlobalKnownHostsFile /dev/null",
        "  StrictHostKeyChecking yes",
        "  BatchMode yes",
        "  ConnectTimeout 10",
        "  LogLevel ERROR",
        "",
    ])


def _check_prerequisites():
    missing = [tool for tool in ("ssh", "ssh-keygen") if shutil.which(tool) is None]
    if _find_sshd() is None:
        missing.append("sshd")
    if missing:
        why = ("%s not installed: run `sudo bash scripts/test-deps.sh` (openssh-server, "
               "openssh-client)" % ", ".join(missing))
        pytest.fail(why)
    if not patching.check():
        pytest.fail("MXNet's launcher is not patched for this Python: run mxps-patch apply")


@pytest.fixture(scope="module")
def ssh_hosts():
    """The hosts, for the whole module; afterwards nothing is left: no namespace, process,
    mount or file (keys and secrets included: failures quote the logs they need)."""
    _check_prerequisites()
    base = tempfile.mkdtemp(prefix="mxps-ssh-")     # mode 0700
    made_privsep = False
    topo = emunet.Topology(NODES)
    try:
        if not os.path.isdir(PRIVSEP_DIR):      # sshd's compiled-in privilege separation dir
            os.makedirs(PRIVSEP_DIR, mode=0o755)
            made_privsep = True
        topo.start()
        yield _start_hosts(topo, base)
    finally:
        try:
            topo.close()
        finally:
            if made_privsep:
                os.rmdir(PRIVSEP_DIR)
            shutil.rmtree(base)
        left = [n for n in topo.namespaces if n in _netns_list()]
        assert not left, "namespaces left behind: %s" % left


def _netns_list():
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _start_hosts(topo, base):
    """Keys, per-node secret copies, one sshd per host, the client side for the launcher."""
    client_key = os.path.join(base, "client_key")
    _keygen(client_key)
    authorized_keys = os.path.join(base, "authorized_keys")
    _write(authorized_keys, _read(client_key + ".pub"))
    secret_dir = os.path.join(base, "etc", "mxps")
    os.makedirs(secret_dir, mode=0o700)
    job_secret, odd_secret = secrets.token_hex(32), secrets.token_hex(32)
    private_dirs = {}
    for node in NODES:
        d = os.path.join(base, "fs", node, "mxps")
        os.makedirs(d, mode=0o700)
        _write(os.path.join(d, "job.secret"), job_secret + "\n")
        _write(os.path.join(d, "mismatch.secret"),
               (odd_secret if node == ODD_HOST else job_secret) + "\n")
        private_dirs[node] = d
    known, sshd, logs = [], {}, {}
    for host in HOSTS:
        host_key = os.path.join(base, "host_key_%s" % host)
        _keygen(host_key)
        known.append("%s %s" % (topo.addr(host), _read(host_key + ".pub").strip()))
        config = os.path.join(base, "sshd_config_%s" % host)
        _write(config, _sshd_config(topo.addr(host), host_key, authorized_keys))
        logs[host] = os.path.join(base, "sshd_%s.log" % host)
        # -D: stay in the foreground (stopped by PID on close); -e: log to stderr
        sshd[host] = topo.start_service(
            host, [_find_sshd(), "-D", "-e", "-f", config], ready=r"Server listening on",
            log_path=logs[host], timeout=30, binds={secret_dir: private_dirs[host]})
    known_hosts = os.path.join(base, "known_hosts")
    _write(known_hosts, "\n".join(known) + "\n")
    client_config = os.path.join(base, "ssh_config")
    _write(client_config, _client_config(client_key, known_hosts))
    bin_dir = os.path.join(base, "bin")
    os.makedirs(bin_dir)
    # dmlc_tracker runs plain `ssh`: this one first on PATH uses the test's key and known hosts
    _write(os.path.join(bin_dir, "ssh"), "#!/bin/sh\nexec %s -F %s \"$@\"\n" % (
        shutil.which("ssh"), client_config), mode=0o755)
    hostfile = os.path.join(base, "hostfile")
    _write(hostfile, "".join("%s:%d\n" % (topo.addr(h), SSH_PORT) for h in HOSTS))
    return SshHosts(topo, base, hostfile, bin_dir, client_config, secret_dir, private_dirs,
                    sshd, logs)


def _ssh(hosts, config, host, command):
    """One ssh from the launcher node, as the test's client (``config``) would run it."""
    argv = [shutil.which("ssh"), "-F", config, "-p", str(SSH_PORT), hosts.topo.addr(host),
            command]
    return subprocess.run(hosts.topo.wrap("launcher", argv), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60)


# --------------------------------------------------------------------------- launching

@dataclasses.dataclass
class LaunchRun:
    out: str
    rc: int
    seconds: float
    timed_out: bool
    output: str                 # launch.py's stdout + stderr, the hosts' nodes' included
    lingering: List[str]        # processes still running LINGER_SECONDS after launch.py

    def tail(self, chars=4000):
        return self.output[-chars:]

    def records(self):
        recs = []
        for path in sorted(glob.glob(os.path.join(self.out, "node_*.json"))):
            with open(path) as f:
                recs.append(json.load(f))
        return recs


def _launch(hosts, name, secret_name, timeout, settings=None):
    """Run MXNet's ssh launcher in the launcher node: 2 workers, 2 servers on the hosts."""
    run_dir = os.path.join(hosts.base, name)
    os.makedirs(run_dir)
    out = os.path.join(run_dir, "out")
    recorder = os.path.join(run_dir, "record_node.py")
    _write(recorder, RECORDER, mode=0o644)
    assignments = dict(cluster.train_env("mxps", steps=5), JOB_OUT=out,
                       MXPS_SECRET_FILE=hosts.secret_file(secret_name), **FORWARDED)
    assignments.update(settings or {})
    command = ["%s=%s" % kv for kv in sorted(assignments.items())]
    command += [sys.executable, recorder, cluster.TRAIN_JOB]
    unsafe = [w for w in command if not SHELL_SAFE.match(w)]
    assert not unsafe, "dmlc joins the command unquoted into a shell line: %s" % unsafe
    argv = [sys.executable, cli.mxnet_launcher(), "--launcher", "ssh", "-H", hosts.hostfile,
            "-n", "2", "-s", "2", "--env", PROBE] + command
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "MXPS_", "JOB_"))}
    env.update(cluster.QUIET_ENV)
    env.update({"PATH": os.pathsep.join([hosts.bin_dir, os.path.dirname(sys.executable),
                                         env.get("PATH", "")]),
                "DMLC_INTERFACE": emunet.NODE_IFACE, PROBE: "1"})
    log = os.path.join(run_dir, "launch.log")
    start = time.monotonic()
    timed_out = False
    with open(log, "wb") as f:
        proc = hosts.topo.popen("launcher", argv, binds={hosts.secret_dir:
                                                         hosts.private_dirs["launcher"]},
                                cwd=run_dir, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(10)
        seconds = time.monotonic() - start
        lingering = _wait_idle(hosts)
    with open(log, errors="replace") as f:
        output = f.read()
    print("\n[ssh launch %s] rc=%s in %.1f s%s" % (name, proc.returncode, seconds,
                                                  " (timed out)" if timed_out else ""))
    return LaunchRun(out, proc.returncode, seconds, timed_out, output, lingering)


def _signal_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_idle(hosts):
    """Wait for what launch.py left running (its ssh clients, the hosts' job processes);
    stop and return, described, whatever is still running after LINGER_SECONDS."""
    deadline = time.monotonic() + LINGER_SECONDS
    lingering = []
    for node in NODES:
        keep = [hosts.sshd[node].pid] if node in hosts.sshd else []
        left = hosts.topo.wait_node_idle(node, max(0.0, deadline - time.monotonic()), keep)
        for pid in left:
            lingering.append("%s: %s" % (node, _describe(pid)))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return lingering


def _describe(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return "%d %s" % (pid, f.read().replace(b"\0", b" ").decode(errors="replace")[:200])
    except OSError:
        return str(pid)


@pytest.fixture(scope="module")
def good_run(ssh_hosts):
    return _launch(ssh_hosts, "agreeing", "job.secret", JOB_TIMEOUT)


@pytest.fixture(scope="module")
def mismatch_run(ssh_hosts):
    return _launch(ssh_hosts, "disagreeing", "mismatch.secret", MISMATCH_TIMEOUT,
                   {"MXPS_START_TIMEOUT": str(MISMATCH_START_TIMEOUT)})


# --------------------------------------------------------------------------- tests

def test_each_host_admits_root_with_the_job_key_only(ssh_hosts):
    for host in HOSTS:
        done = _ssh(ssh_hosts, ssh_hosts.client_config, host, "echo $SSH_CONNECTION")
        assert done.returncode == 0, "ssh to %s: %s\n%s" % (host, done.stderr,
                                                            ssh_hosts.sshd_log_tails())
        assert done.stdout.split()[2] == ssh_hosts.topo.addr(host), done.stdout
    other_key = os.path.join(ssh_hosts.base, "other_key")
    _keygen(other_key)
    other_config = os.path.join(ssh_hosts.base, "other_config")
    known_hosts = re.search(r"UserKnownHostsFile (\S+)", _read(ssh_hosts.client_config))
    _write(other_config, _client_config(other_key, known_hosts.group(1)))
    refused = _ssh(ssh_hosts, other_config, HOSTS[0], "true")
    assert refused.returncode == 255, refused
    # only publickey is offered: no password or keyboard-interactive fallback
    assert "Permission denied (publickey)" in refused.stderr, refused.stderr


def test_ssh_launched_job_trains_with_every_worker_holding_the_same_weights(good_run):
    assert not good_run.timed_out, "launch.py still ran after %d s:\n%s" % (
        JOB_TIMEOUT, good_run.tail())
    assert good_run.rc == 0, good_run.tail()
    # the scheduler runs in a thread of launch.py, which prints a failed one's traceback
    assert "CalledProcessError" not in good_run.output, good_run.tail()
    # every node read the secret: none warns that it listens without one
    assert not re.search(r"without a job secret", good_run.output, re.I), good_run.tail()
    cluster.assert_synchronised(good_run.out, 2, kvstore_type="dist_sync")
    for rank in range(2):
        meta = cluster.load_meta(good_run.out, rank)
        assert meta["kvstore_requested"] == "mxps" and meta["steps"] == 5, meta
    assert not good_run.lingering, \
        "still running %d s after launch.py exited (stopped by the test): %s" % (
            LINGER_SECONDS, good_run.lingering)


def test_servers_and_workers_ran_on_the_hosts_over_ssh_and_the_scheduler_on_the_launcher(
        ssh_hosts, good_run):
    records = good_run.records()
    roles = sorted(r["role"] for r in records)
    assert roles == ["scheduler", "server", "server", "worker", "worker"], good_run.tail()
    launcher = ssh_hosts.topo.addr("launcher")
    host_addrs = {ssh_hosts.topo.addr(h) for h in HOSTS}
    used = set()
    for rec in records:
        assert rec["dmlc"]["DMLC_PS_ROOT_URI"] == launcher, rec
        assert ipaddress.ip_address(rec["dmlc"]["DMLC_PS_ROOT_URI"]) in NAMESPACE_NET, rec
        if rec["role"] == "scheduler":
            assert rec["ssh_connection"] is None, rec       # started locally by dmlc's tracker
            continue
        client, _, server, _ = rec["ssh_connection"].split()
        assert client == launcher, rec
        assert server == rec["dmlc"]["DMLC_NODE_HOST"] and server in host_addrs, rec
        used.add(server)
    assert used == host_addrs, "nodes ran on %s, not on every host %s" % (used, host_addrs)


def test_the_secret_file_named_in_the_command_reached_every_node_and_env_did_not(
        ssh_hosts, good_run):
    records = good_run.records()
    assert len(records) == 5, good_run.tail()
    for rec in records:
        assert rec["secret_file"] == ssh_hosts.secret_file("job.secret"), rec
        assert not rec["mxps_secret_set"], rec
        assert not rec["secret_sha256"].startswith("unreadable"), rec
        # dmlc's ssh launcher ignores --env: only the local scheduler has the variable
        assert rec["probe"] == ("1" if rec["role"] == "scheduler" else None), rec
    assert len({rec["secret_sha256"] for rec in records}) == 1, records
    # each node's copy was private to it: nothing shows at that path outside the nodes
    assert os.listdir(ssh_hosts.secret_dir) == []


def test_a_host_whose_sshd_cannot_start_is_named_with_sshds_own_message(ssh_hosts):
    base = ssh_hosts.base
    config = os.path.join(base, "sshd_config_broken")
    _write(config, _sshd_config(ssh_hosts.topo.addr(HOSTS[1]), os.path.join(base, "no_such_key"),
                                os.path.join(base, "authorized_keys")))
    with pytest.raises(emunet.EmunetError) as info:
        ssh_hosts.topo.start_service(HOSTS[1], [_find_sshd(), "-D", "-e", "-f", config],
                                     ready=r"Server listening on",
                                     log_path=os.path.join(base, "broken.log"), timeout=30)
    message = str(info.value)
    assert "node 'h1'" in message and "before it was ready" in message, message
    assert "no hostkeys available" in message, message


def test_hosts_disagreeing_on_the_secret_fail_at_rendezvous_with_a_clear_message(
        ssh_hosts, mismatch_run):
    run = mismatch_run
    records = run.records()
    odd_addr = ssh_hosts.topo.addr(ODD_HOST)
    odd = {r["secret_sha256"] for r in records if r["dmlc"].get("DMLC_NODE_HOST") == odd_addr}
    rest = {r["secret_sha256"] for r in records if r["dmlc"].get("DMLC_NODE_HOST") != odd_addr}
    assert len(odd) == 1 and len(rest) == 1 and odd != rest, \
        "the test's hosts do not disagree as intended: %s" % records
    assert not run.timed_out, "launch.py still ran after %d s:\n%s" % (
        MISMATCH_TIMEOUT, run.tail())
    assert not glob.glob(os.path.join(run.out, "weights_rank*.npz")), \
        "a job whose hosts disagree on the secret trained:\n%s" % run.tail()
    # both nodes on the odd host (s0, w1) say why they cannot join, naming the setting
    refused = re.findall(r"did not accept this node's credentials[^\n]*MXPS_SECRET", run.output)
    assert len(refused) >= 2, run.tail()
    # and the scheduler logs whom it refused
    assert re.search(r"refused a connection from %s:\d+[^\n]*MXPS_SECRET" % re.escape(odd_addr),
                     run.output), run.tail()
    assert run.seconds < MISMATCH_START_TIMEOUT + 60, run.seconds
    assert not run.lingering, run.lingering
