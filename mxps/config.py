"""The settings of an mxps node, read once from the environment.

MXNet's launcher passes everything through environment variables (``DMLC_*``), and the kvstore
class is built with no arguments by ``mx.kv.create``; so mxps reads its own ``MXPS_*`` settings
from the environment too, once, validates them, and passes the frozen ``Config`` down.  Library
code does not read ``os.environ`` anywhere else.  Every setting is documented in docs/SETTINGS.md.
"""
import contextlib
import dataclasses
import os
import re


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the variable and the fix."""


ROLES = ("worker", "server", "scheduler")
MODES = ("sync", "async", "wsp")
PLANS = ("default", "chunked", "adaptive")
PUSHES = ("tcp", "ltp")
FILLS = ("rescale", "zero")
# where a node can be made to pause for the failure matrix (MXPS_FAULT_POINT, test-only):
# before its REGISTER, after it before the WELCOME, inside a migration (a server that received
# a MIGRATE part), inside GET_STATES handling (a server asked for its optimizer states); or
# where it drops a message instead: the scheduler's first SHUTDOWN, as if it were lost
FAULT_POINTS = ("register", "welcome", "migrate", "get_states", "shutdown")


@dataclasses.dataclass(frozen=True)
class Config:
    role: str
    root_uri: str
    root_port: int
    num_workers: int
    num_servers: int
    node_host: str
    mode: str = "sync"
    timeout: float = 120.0
    start_timeout: float = 300.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    bigarray_bound: int = 1000 * 1000
    log_level: str = "WARNING"
    plan: str = "default"
    probe_bytes: int = 4 * 1024 * 1024
    min_slice: int = 16384
    max_chunk: int = 262144
    send_window: int = 1 << 20
    push_gather: float = 0.01
    metrics: str = ""
    replan_interval: int = 1
    replan_force: int = 0
    replan_min_gain: float = 0.05
    replan_horizon: int = 20
    replan_light: bool = False
    replan_overlap: bool = False
    replan_seed: bool = False
    # MXPS_FAILOVER (docs/FAILOVER.md): a lost server's slices go to the survivors and the job
    # goes on; off: the job ends with exit code 3 naming the lost server
    failover: bool = False
    # MXPS_REPLICA: every slice's optimizer state also on a buddy server: 1 every round (pulls
    # wait for it), K > 1 every K rounds (lazy: pulls do not wait), 0 none
    replica: int = 0
    # MXPS_DIVERT (docs/REPLAN.md): a server whose acknowledgements slow down inside a round
    # loses its slices to the others in that round (weights from the workers, only its
    # optimizer state crosses its link); MXPS_DIVERT_FORCE=R:S (tests): worker 0 reports
    # server S slow at its first push of round R
    divert: bool = False
    divert_force: tuple = ()
    replan_one_round: bool = True
    replan_window: int = 3
    trace: str = ""
    job_info: str = ""
    hwm: int = 1000
    # MXPS_MODE=wsp: rounds wait for k workers (0: chosen from push intervals), no worker
    # more than wsp_staleness rounds behind (docs/WSP.md)
    wsp_k: int = 0
    wsp_staleness: int = 2
    # MXPS_STORE=disk: every server slice in a row store on disk (docs/STORE.md)
    store: str = "memory"
    store_dir: str = ""
    store_cache_mb: float = 256.0
    store_resume: bool = False
    store_checkpoint_rounds: int = 0    # every N rounds a job-wide checkpoint (0: at the stop)
    store_checkpoint_seconds: float = 0.0   # ... or every S seconds (worker 0 picks the round)
    # MXPS_PUSH=ltp: the loss-tolerant push over UDP (docs/LTP.md)
    push: str = "tcp"
    ltp_fill: str = "rescale"
    ltp_ratio: float = 0.0          # 0: adaptive (mxps.ltp.close.acceptance_ratio)
    ltp_deadline: float = -1.0      # -1: adaptive, 0: no deadline, else seconds
    ltp_grace: float = 0.002
    ltp_min_bytes: int = 65536
    ltp_mtu: int = 0                # 0: the server's interface MTU
    ltp_drop: float = 0.0           # test-only: drop this fraction of DATA packets at the sender
    ltp_seed: int = 0
    ltp_quantum: float = 0.001      # s: a paced path is pumped at most this often (ltp.sender)
    ltp_critical_first: bool = True  # pushes that go by TCP skip the priority queue
    ltp_grace_always: bool = False  # the grace after the last END even on paths that keep order
    ltp_end_copies: int = 4         # the most copies an END goes as on a lossy path
    ltp_end_rto: str = "rtt"        # the END's timeout rule (ltp.sender.END_TIMEOUTS)
    ltp_busy_windows: bool = True   # the grant's capacity over the link's busy time (ltp.share)
    ltp_owing: bool = True          # the grant shared by the workers that owe an open round
    ltp_fair: bool = True           # the grant leaves other processes' TCP flows their share
    ltp_probe_loss: bool = True     # the grant's probe makes up for the workers' loss
    ltp_startup: bool = True        # the grant's capacity starts as BBR's STARTUP (ltp.share)
    ltp_fast: bool = True           # the server adds most packets in C (kernels.ltp.intake)
    # test-only fault injection (docs/SETTINGS.md): pause at ``fault_point`` for
    # ``fault_hold`` seconds after announcing it in ``fault_dir`` (see roles.link.fault_point)
    fault_point: str = ""
    fault_hold: float = 60.0
    fault_dir: str = ""
    # the job secret (MXPS_SECRET / MXPS_SECRET_FILE); empty: unauthenticated.  Never in a
    # repr, so never in a log line or a traceback that prints the Config.
    secret: bytes = dataclasses.field(default=b"", repr=False)

    @property
    def replanning(self):
        """Live re-planning runs with the adaptive plan (or when forced, for tests)."""
        return self.replan_interval > 0 and (self.plan == "adaptive" or self.replan_force)

    @property
    def sync(self):
        """Rounds (sync and wsp): pushes are summed per round, pulls wait for their round."""
        return self.mode in ("sync", "wsp")


def _get(env, name, default=None, required=False):
    v = env.get(name)
    if v is None or v == "":
        if required:
            raise ConfigError("%s is not set: start the job with MXNet's launcher "
                              "(mxnet/tools/launch.py), which sets the DMLC_* variables, or set "
                              "it by hand" % name)
        return default
    return v


def _int(env, name, default=None, required=False, minimum=None):
    v = _get(env, name, default, required)
    try:
        v = int(v)
    except (TypeError, ValueError):
        raise ConfigError("%s=%r is not an integer" % (name, env.get(name))) from None
    if minimum is not None and v < minimum:
        raise ConfigError("%s=%d must be at least %d" % (name, v, minimum))
    return v


def _float(env, name, default, minimum=0.0):
    v = _get(env, name, default)
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise ConfigError("%s=%r is not a number" % (name, env.get(name))) from None
    if not v > minimum:
        raise ConfigError("%s=%s must be greater than %s" % (name, v, minimum))
    return v


def _push_gather(env):
    v = _float(env, "MXPS_PUSH_GATHER", 0.01, minimum=-1.0)
    if not 0 <= v <= 1:
        raise ConfigError("MXPS_PUSH_GATHER=%s: seconds in [0, 1] (0: no hold)" % v)
    return v


def _bool(env, name, default=False):
    v = _get(env, name)
    if v is None:
        return default
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError("%s=%r: use 1 or 0" % (name, v))


def _store(env):
    """MXPS_STORE (memory or disk), MXPS_STORE_DIR, MXPS_STORE_CACHE_MB, MXPS_STORE_RESUME,
    MXPS_STORE_CHECKPOINT_ROUNDS, MXPS_STORE_CHECKPOINT_SECONDS."""
    kind = (_get(env, "MXPS_STORE", "memory")).lower()
    if kind not in ("memory", "disk"):
        raise ConfigError("MXPS_STORE=%r: use memory or disk" % kind)
    directory = _get(env, "MXPS_STORE_DIR", "")
    resume = _bool(env, "MXPS_STORE_RESUME", False)
    if kind == "disk" and not directory:
        raise ConfigError("MXPS_STORE=disk needs MXPS_STORE_DIR: the directory the servers' "
                          "tables go to (one subdirectory per server)")
    if resume and kind != "disk":
        raise ConfigError("MXPS_STORE_RESUME=1 resumes a disk store: set MXPS_STORE=disk and "
                          "MXPS_STORE_DIR")
    every = _int(env, "MXPS_STORE_CHECKPOINT_ROUNDS", 0, minimum=0)
    seconds = _float(env, "MXPS_STORE_CHECKPOINT_SECONDS", 0.0, minimum=float("-inf"))
    if seconds < 0:
        raise ConfigError("MXPS_STORE_CHECKPOINT_SECONDS=%g must be at least 0" % seconds)
    for name, v in (("MXPS_STORE_CHECKPOINT_ROUNDS", every),
                    ("MXPS_STORE_CHECKPOINT_SECONDS", seconds)):
        if v and kind != "disk":
            raise ConfigError("%s=%g checkpoints a disk store: set MXPS_STORE=disk and "
                              "MXPS_STORE_DIR" % (name, v))
    return {"store": kind, "store_dir": directory, "store_resume": resume,
            "store_cache_mb": _float(env, "MXPS_STORE_CACHE_MB", 256.0),
            "store_checkpoint_rounds": every, "store_checkpoint_seconds": seconds}


def _wsp(env):
    """MXPS_WSP_K (``auto`` or 1..W) and MXPS_WSP_STALENESS (docs/WSP.md)."""
    k = (_get(env, "MXPS_WSP_K", "auto")).lower()
    if k == "auto":
        k = 0
    else:
        k = _int(env, "MXPS_WSP_K", minimum=1)
        workers = env.get("DMLC_NUM_WORKER")
        if workers and workers.isdigit() and k > int(workers):
            raise ConfigError("MXPS_WSP_K=%d exceeds DMLC_NUM_WORKER=%s" % (k, workers))
    return {"wsp_k": k, "wsp_staleness": _int(env, "MXPS_WSP_STALENESS", 2, minimum=0)}


def _ltp(env):
    """The MXPS_PUSH / MXPS_LTP_* settings (docs/SETTINGS.md, docs/LTP.md)."""
    push = (_get(env, "MXPS_PUSH", "tcp")).lower()
    if push not in PUSHES:
        raise ConfigError("MXPS_PUSH=%r: use %s" % (push, " or ".join(PUSHES)))
    fill = (_get(env, "MXPS_LTP_FILL", "rescale")).lower()
    if fill not in FILLS:
        raise ConfigError("MXPS_LTP_FILL=%r: use %s" % (fill, " or ".join(FILLS)))
    ratio = _get(env, "MXPS_LTP_RATIO", "auto").lower()
    if ratio == "auto":
        ratio = 0.0
    else:
        ratio = _float(env, "MXPS_LTP_RATIO", None)
        if ratio > 1:
            raise ConfigError("MXPS_LTP_RATIO=%s: an acceptance ratio is a fraction in (0, 1] "
                              "(or auto)" % ratio)
    deadline = _get(env, "MXPS_LTP_DEADLINE", "auto").lower()
    if deadline == "auto":
        deadline = -1.0
    elif deadline in ("off", "0"):
        deadline = 0.0
    else:
        deadline = _float(env, "MXPS_LTP_DEADLINE", None)
    drop = _get(env, "MXPS_LTP_DROP", "0")
    try:
        drop = float(drop)
    except ValueError:
        raise ConfigError("MXPS_LTP_DROP=%r is not a number" % drop) from None
    if not 0 <= drop < 1:
        raise ConfigError("MXPS_LTP_DROP=%s: a fraction in [0, 1)" % drop)
    mtu = _int(env, "MXPS_LTP_MTU", 0, minimum=0)
    if mtu and mtu < 576:
        raise ConfigError("MXPS_LTP_MTU=%d: IPv4 paths carry at least 576 bytes; use 576 or "
                          "more (or 0: the server's interface MTU)" % mtu)
    quantum = _float(env, "MXPS_LTP_QUANTUM", 0.001, minimum=-1.0)
    if not 0 <= quantum <= 1:
        raise ConfigError("MXPS_LTP_QUANTUM=%s: seconds in [0, 1] (0: pump for every packet)"
                          % quantum)
    end_rto = _get(env, "MXPS_LTP_END_RTO", "rtt").lower()
    if end_rto not in ("rtt", "min_rtt"):
        raise ConfigError("MXPS_LTP_END_RTO=%s: rtt (RFC 6298's srtt + 4 rttvar) or min_rtt "
                          "(4 x the minimum RTT, for ablations)" % end_rto)
    return dict(push=push, ltp_fill=fill, ltp_ratio=ratio, ltp_deadline=deadline,
                ltp_grace=_float(env, "MXPS_LTP_GRACE", 0.002),
                ltp_critical_first=_bool(env, "MXPS_LTP_CRITICAL_FIRST", True),
                ltp_min_bytes=_int(env, "MXPS_LTP_MIN_BYTES", 65536, minimum=0),
                ltp_mtu=mtu, ltp_drop=drop, ltp_seed=_int(env, "MXPS_LTP_SEED", 0),
                ltp_quantum=quantum,
                ltp_grace_always=_bool(env, "MXPS_LTP_GRACE_ALWAYS", False),
                ltp_end_copies=_int(env, "MXPS_LTP_END_COPIES", 4, minimum=1),
                ltp_end_rto=end_rto,
                ltp_busy_windows=_bool(env, "MXPS_LTP_BUSY_WINDOWS", True),
                ltp_owing=_bool(env, "MXPS_LTP_OWING", True),
                ltp_fair=_bool(env, "MXPS_LTP_FAIR", True),
                ltp_probe_loss=_bool(env, "MXPS_LTP_PROBE_LOSS", True),
                ltp_startup=_bool(env, "MXPS_LTP_STARTUP", True),
                ltp_fast=_bool(env, "MXPS_LTP_FAST", True))


ltp_settings = _ltp       # the LTP settings alone (mxps.ltp.incast, the push-alone benchmark)


MIN_SECRET_BYTES = 16
MAKE_SECRET = "python -c 'import secrets; print(secrets.token_hex(32))'"


def _secret(env):
    """The job secret as bytes (b"" when neither variable is set).

    MXPS_SECRET holds it; MXPS_SECRET_FILE names a file holding it (surrounding whitespace
    stripped), which keeps it off command lines: MXNet's ssh launcher forwards only its own
    DMLC_* variables (its ``--env`` is for yarn), so the variable goes before the command,
    ``launch.py --launcher ssh ... MXPS_SECRET_FILE=/path python train.py``.  Too short a secret is refused: every node derives
    its keys from it, and a short one can be guessed by trying handshakes."""
    value, path = _get(env, "MXPS_SECRET"), _get(env, "MXPS_SECRET_FILE")
    if value is not None and path is not None:
        raise ConfigError("MXPS_SECRET and MXPS_SECRET_FILE are both set: set only one")
    name = "MXPS_SECRET"
    if path is not None:
        name = "MXPS_SECRET_FILE=%s" % path
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ConfigError("MXPS_SECRET_FILE=%s cannot be read: %s" % (
                path, e.strerror or e)) from None
        if not secret:
            raise ConfigError("MXPS_SECRET_FILE=%s is empty: it must hold the job secret" % path)
    elif value is not None:
        secret = value.strip().encode()
    else:
        return b""
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError("%s: the job secret has %d bytes, at least %d are needed (make one "
                          "with %s)" % (name, len(secret), MIN_SECRET_BYTES, MAKE_SECRET))
    return secret


def _divert_force(env):
    raw = _get(env, "MXPS_DIVERT_FORCE", "")
    if not raw:
        return ()
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", raw)
    if m is None or int(m.group(1)) < 1:
        raise ConfigError("MXPS_DIVERT_FORCE=%r: expected ROUND:SERVER (round >= 1), e.g. 3:1"
                          % raw)
    return (int(m.group(1)), int(m.group(2)))


def _fault(env):
    """The test-only fault switches (MXPS_FAULT_POINT, MXPS_FAULT_HOLD, MXPS_FAULT_DIR)."""
    point = (_get(env, "MXPS_FAULT_POINT", "")).lower()
    if not point:
        return {}
    if point not in FAULT_POINTS:
        raise ConfigError("MXPS_FAULT_POINT=%r: expected one of %s (a test-only switch)"
                          % (point, ", ".join(FAULT_POINTS)))
    where = _get(env, "MXPS_FAULT_DIR")
    if where is None or not os.path.isdir(where):
        raise ConfigError("MXPS_FAULT_POINT=%s needs MXPS_FAULT_DIR, an existing directory for "
                          "its marker file (MXPS_FAULT_DIR=%r)" % (point, where))
    return {"fault_point": point, "fault_hold": _float(env, "MXPS_FAULT_HOLD", 60.0),
            "fault_dir": where}


def pure_python(env=None):
    """MXPS_PURE_PYTHON=1: use the pure-Python twins of the compiled hot paths."""
    return _bool(os.environ if env is None else env, "MXPS_PURE_PYTHON")


def mxnet_update_on_kvstore(env=None):
    """MXNet's own MXNET_UPDATE_ON_KVSTORE (default 1), read when a Trainer or Module builds
    its kvstore, as MXNet reads it."""
    return _bool(os.environ if env is None else env, "MXNET_UPDATE_ON_KVSTORE", True)


@contextlib.contextmanager
def role_hidden():
    """Within the block DMLC_ROLE reads "worker": ``import mxnet`` in a server or scheduler
    process would otherwise start MXNet's native ps-lite node and never return."""
    saved = os.environ.get("DMLC_ROLE")
    os.environ["DMLC_ROLE"] = "worker"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DMLC_ROLE", None)
        else:
            os.environ["DMLC_ROLE"] = saved


def role_from_env(env=None):
    """The node's role from DMLC_ROLE (default: worker, as in ps-lite)."""
    env = os.environ if env is None else env
    role = (env.get("DMLC_ROLE") or "worker").lower()
    if role not in ROLES:
        raise ConfigError("DMLC_ROLE=%r: expected one of %s" % (role, ", ".join(ROLES)))
    return role


def default_max_chunk(num_workers):
    """``MXPS_MAX_CHUNK``'s default, in elements: a chunk whose copies from all ``num_workers``
    workers make 2 MB of float32 (524288 elements), but at least 256 KB and at most 1 MB.

    A server answers a chunk's pulls only once every worker has pushed it, so on a server
    whose link is the bottleneck the step ends W x chunk / link rate after the last push (the
    pulls of the last chunk), and the server's outgoing link idles as long before the first
    chunk is complete: both grow with W x chunk.  Smaller chunks cost a round each (an END, a
    close, an optimizer call and W pulls), so they stop at 256 KB (64 Ki elements; the
    smallest slice LTP takes, ``MXPS_LTP_MIN_BYTES``, is 64 KB).  Measured
    (docs/bench/ltp_chunk_size.json): 8 workers -> 1 server, a 3.1 MB key, 0% loss, mxps-ltp:
    1 MB chunks 0.806 s/step, 512 KB 0.704, 256 KB 0.663 (floor 0.547)."""
    return max(65536, min(262144, 524288 // max(1, int(num_workers))))


def from_env(env=None, mode=None):
    """Build the Config from ``env`` (default os.environ).

    ``mode`` overrides MXPS_MODE (the kvstore name ``mxps_async`` selects async).
    """
    env = os.environ if env is None else env
    role = role_from_env(env)
    if mode is None:
        mode = (_get(env, "MXPS_MODE", "sync")).lower()
    if mode not in MODES:
        raise ConfigError("MXPS_MODE=%r: expected 'sync', 'async' or 'wsp'" % mode)
    plan = (_get(env, "MXPS_PLAN", "default")).lower()
    if plan not in PLANS:
        raise ConfigError("MXPS_PLAN=%r: expected one of %s" % (plan, ", ".join(PLANS)))
    num_workers = _int(env, "DMLC_NUM_WORKER", required=True, minimum=1)
    level = _get(env, "MXPS_LOG_LEVEL", "WARNING").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError("MXPS_LOG_LEVEL=%r: expected DEBUG, INFO, WARNING or ERROR" % level)
    cfg = Config(
        role=role,
        root_uri=_get(env, "DMLC_PS_ROOT_URI", required=True),
        root_port=_int(env, "DMLC_PS_ROOT_PORT", required=True, minimum=1),
        num_workers=num_workers,
        num_servers=_int(env, "DMLC_NUM_SERVER", required=True, minimum=1),
        node_host=_get(env, "DMLC_NODE_HOST") or _get(env, "MXPS_NODE_HOST") or "",
        mode=mode,
        timeout=_float(env, "MXPS_TIMEOUT", 120.0),
        start_timeout=_float(env, "MXPS_START_TIMEOUT", 300.0),
        heartbeat_interval=_float(env, "MXPS_HEARTBEAT_INTERVAL", 1.0),
        heartbeat_timeout=_float(env, "MXPS_HEARTBEAT_TIMEOUT", 10.0),
        bigarray_bound=_int(env, "MXNET_KVSTORE_BIGARRAY_BOUND", 1000 * 1000, minimum=1),
        log_level=level,
        plan=plan,
        probe_bytes=_int(env, "MXPS_PROBE_BYTES", 4 * 1024 * 1024, minimum=1024),
        min_slice=_int(env, "MXPS_MIN_SLICE", 16384, minimum=1),
        max_chunk=_int(env, "MXPS_MAX_CHUNK", default_max_chunk(num_workers), minimum=0),
        send_window=_int(env, "MXPS_SEND_WINDOW", 1 << 20, minimum=1),
        push_gather=_push_gather(env),
        metrics=_get(env, "MXPS_METRICS", ""),
        replan_interval=_int(env, "MXPS_REPLAN_INTERVAL", 1, minimum=0),
        replan_force=_int(env, "MXPS_REPLAN_FORCE", 0, minimum=0),
        replan_min_gain=_float(env, "MXPS_REPLAN_MIN_GAIN", 0.05),
        replan_horizon=_int(env, "MXPS_REPLAN_HORIZON", 20, minimum=1),
        replan_light=_bool(env, "MXPS_REPLAN_LIGHT", False),
        replan_overlap=_bool(env, "MXPS_REPLAN_OVERLAP", False),
        replan_seed=_bool(env, "MXPS_REPLAN_SEED", False),
        failover=_bool(env, "MXPS_FAILOVER", False),
        replica=_int(env, "MXPS_REPLICA", 0, minimum=0),
        divert=_bool(env, "MXPS_DIVERT", False),
        divert_force=_divert_force(env),
        replan_one_round=_bool(env, "MXPS_REPLAN_ONE_ROUND", True),
        replan_window=_int(env, "MXPS_REPLAN_WINDOW", 3, minimum=1),
        trace=_get(env, "MXPS_TRACE", ""),
        job_info=_get(env, "MXPS_JOB_INFO", ""),
        hwm=_int(env, "MXPS_HWM", 1000, minimum=16),
        **_wsp(env),
        **_store(env),
        **_ltp(env),
        secret=_secret(env),
        **_fault(env),
    )
    if cfg.root_port > 65535:
        raise ConfigError("DMLC_PS_ROOT_PORT=%d is not a TCP port" % cfg.root_port)
    if cfg.replanning and (cfg.store_resume or cfg.store_checkpoint_rounds
                           or cfg.store_checkpoint_seconds):
        raise ConfigError("MXPS_STORE_RESUME / MXPS_STORE_CHECKPOINT_* and live re-planning "
                          "(MXPS_PLAN=adaptive) do not go together yet: a checkpoint holds the "
                          "tables of the plan of its round, a resumed job starts from its "
                          "start-up plan; set MXPS_REPLAN_INTERVAL=0 or another MXPS_PLAN")
    if cfg.failover and cfg.mode != "sync":
        raise ConfigError("MXPS_FAILOVER=1 needs MXPS_MODE=sync (dist_sync): a successor "
                          "rebuilds a lost slice from the rounds every worker pulled; in %s "
                          "mode workers hold weights of different rounds" % cfg.mode)
    if cfg.replica and not (cfg.failover or cfg.divert):
        raise ConfigError("MXPS_REPLICA=1 keeps the optimizer state for a failover or a "
                          "divert: set MXPS_FAILOVER=1 or MXPS_DIVERT=1 too")
    if cfg.failover and cfg.push == "ltp":
        raise ConfigError("MXPS_FAILOVER=1 and MXPS_PUSH=ltp do not go together yet: an LTP "
                          "push to a lost server cannot be sent again (use MXPS_PUSH=tcp)")
    if cfg.divert_force and not cfg.divert:
        raise ConfigError("MXPS_DIVERT_FORCE needs MXPS_DIVERT=1")
    if cfg.divert and (cfg.mode != "sync" or cfg.push == "ltp" or not cfg.replanning):
        raise ConfigError("MXPS_DIVERT=1 re-routes a slow server's round inside the round: it "
                          "needs MXPS_PLAN=adaptive with re-planning, MXPS_MODE=sync and "
                          "MXPS_PUSH=tcp")
    if cfg.heartbeat_timeout <= 2 * cfg.heartbeat_interval:
        raise ConfigError("MXPS_HEARTBEAT_TIMEOUT=%s must exceed twice MXPS_HEARTBEAT_INTERVAL=%s"
                          % (cfg.heartbeat_timeout, cfg.heartbeat_interval))
    return cfg
