"""MXPS_TRACE: a per-step trace of every node's transfers, for timelines of where a step goes.

With ``MXPS_TRACE=PREFIX`` every worker writes ``PREFIX.worker<rank>`` at its clean exit and
every server ``PREFIX.server<rank>`` at its clean shutdown (a path with ``{rank}`` is formatted
with the rank, and ``{role}`` with the role; a template without ``{role}`` keeps the worker's
name as it is and gets ``.server`` appended for a server).  Nothing is recorded when it is off:
each hook is one ``if trace is not None``; when on, a hook appends one tuple to a list.

The clock is ``time.time()`` (wall seconds since the epoch): every node of a bench or a test
job runs on one host, where that clock is the same for all processes, so a server's record can
be ordered against a worker's (a causal chain across processes never runs backwards on it).
Nodes on different hosts would need their clocks synchronised for cross-node comparisons; the
records of one node are always in the order they happened.

The file (JSON)::

    {"format": "mxps-trace/1", "role": "worker" | "server", "rank": R,
     "clock": "time.time", "tables": {NAME: {"columns": [...], "rows": [[...], ...]}},
     "plans": {"<version>": {"<key>": [[server, offset, length], ...]}}}      # workers only

Rows are in the order they were recorded; ``kind`` is always the first column and ``time`` the
second.  Tables and kinds (docs/TRACE.md tells how to read them):

worker ``requests`` (the I/O thread; one row per event of a data request, ``REQUEST_COLUMNS``)
    ``push_queued`` (handed to the I/O thread), ``push_held`` (in the per-server queue waiting
    for send credit, MXPS_SEND_WINDOW), ``push_released`` (credit granted), ``push_sent``
    (on the connection), ``push_acked`` (the server's receipt); ``pull_queued``,
    ``pull_sent``, ``pull_answered`` (``bytes``: the reply's); ``pushpull_*`` likewise for an
    unsplit PUSHPULL (async mode).  ``reply_unusable``: a reply whose callback failed (the
    request stays pending).  ``round`` is the request's iteration (the key's push count),
    ``plan_version`` the plan it was built with, ``request`` its id (per worker).
worker ``points`` (the adapter, training thread; ``POINT_COLUMNS``)
    ``round_begin`` (the first push of ``round`` is about to be issued; the re-plan point, if
    any, follows), ``drain_start`` / ``drain_end`` (waiting for this worker's operations in
    flight), ``replan_sent`` (the REPLAN report handed to the I/O thread; ``full`` 1 or 0),
    ``replan_answer`` (the scheduler's answer read: ``new_version`` is the plan in force from
    then on; for a light point this is when the next point read it).
worker ``paths`` (MXPS_PUSH=ltp only: the I/O thread, every ``PATH_SAMPLE`` s while the worker
    has LTP paths; ``PATH_COLUMNS``)
    ``ltp_path``: one row per path to a server: its BBR state, pacing rate, bottleneck rate
    estimate, ``ceiling`` (the server's last grant, the rate the path may not exceed), minimum
    and smoothed RTT, congestion window (bytes; None while it is open: no RTT sample yet),
    bytes in flight, pushes queued or awaiting their END's ACK, and the path's sent,
    delivered and lost byte counters (bytes/s, s, bytes).
server ``data`` (``SERVER_DATA_COLUMNS``; ``worker`` -1 where no worker applies)
    ``push_arrived``, ``round_complete`` (the round's pushes summed and the optimizer applied,
    or the sum stored; in async every push is a round of its own), ``pull_parked`` (a pull of a round
    not complete yet), ``pull_answered``, ``request_deferred`` (overlapped re-plan: a request
    for a slice still being built waits for it; a push is acked at once and its
    ``push_arrived`` follows when the slice is built).
server ``plan`` (``SERVER_PLAN_COLUMNS``)
    ``plan_received``, ``plan_failed``, ``part_sent`` (to ``peer``), ``part_received`` (from
    ``peer``; its ``plan_version`` may be one ahead of the server's: an early part),
    ``part_acked`` (by ``peer``; ``part_refused`` if it answered with an ERROR),
    ``slice_built`` (a new slice assembled from its parts), ``plan_in_place`` (``bytes``: what
    this server sent).  ``part`` is the part's id, per sending server and plan.
"""
import json
import time

FORMAT = "mxps-trace/1"

PATH_SAMPLE = 0.05     # seconds between two samples of the LTP paths (table ``paths``)

# the clock of every record (see the module docstring)
clock = time.time

REQUEST_COLUMNS = ("kind", "time", "round", "server", "key", "offset", "length", "bytes",
                   "plan_version", "request")
POINT_COLUMNS = ("kind", "time", "round", "plan_version", "new_version", "full")
PATH_COLUMNS = ("kind", "time", "server", "state", "pacing_rate", "btl_bw", "ceiling", "min_rtt",
                "srtt", "cwnd", "inflight", "queued", "sent_bytes", "delivered_bytes",
                "lost_bytes")
SERVER_DATA_COLUMNS = ("kind", "time", "round", "key", "offset", "length", "worker", "bytes",
                       "plan_version", "request")
SERVER_PLAN_COLUMNS = ("kind", "time", "plan_version", "key", "offset", "length", "peer",
                       "bytes", "part")

TABLES = {
    "worker": {"requests": REQUEST_COLUMNS, "points": POINT_COLUMNS, "paths": PATH_COLUMNS},
    "server": {"data": SERVER_DATA_COLUMNS, "plan": SERVER_PLAN_COLUMNS},
}


def path_for(template, role, rank):
    """The file of node ``role`` ``rank`` for MXPS_TRACE=``template`` (module docstring)."""
    if "{rank}" in template or "{role}" in template:
        path = template.format(rank=rank, role=role)
        if "{role}" not in template and role != "worker":
            path += "." + role
        return path
    return "%s.%s%d" % (template, role, rank)


class Recorder:
    """One node's trace: a list of rows per table (``rows[name]``), written by ``write``.

    The hooks append tuples to ``rows[name]`` directly (list.append is atomic under the GIL,
    so the I/O thread and the threads that submit may share a list)."""

    def __init__(self, role, rank, now=None):
        self.role = role
        self.rank = rank
        self.clock = now or clock     # a test may give its own
        self.rows = {name: [] for name in TABLES[role]}
        self.plans = {}

    def write(self, template):
        """Write the trace to its file; returns the path."""
        path = path_for(template, self.role, self.rank)
        tables = {name: {"columns": list(TABLES[self.role][name]), "rows": list(rows)}
                  for name, rows in self.rows.items()}
        body = {"format": FORMAT, "role": self.role, "rank": self.rank, "clock": "time.time",
                "tables": tables}
        if self.role == "worker":
            body["plans"] = {str(v): t for v, t in sorted(self.plans.items())}
        with open(path, "w") as f:
            json.dump(body, f, separators=(",", ":"))
        return path

    def save(self, template, log):
        """``write``, logging where the trace went or why it could not be written (a trace
        is never worth failing a finished job for)."""
        try:
            path = self.write(template)
        except OSError as e:
            log.error("%s %d: cannot write the trace (MXPS_TRACE=%s): %s", self.role,
                      self.rank, template, e)
            return None
        log.info("%s %d: trace written to %s", self.role, self.rank, path)
        return path
