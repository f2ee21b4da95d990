"""What a server's optional features follow, as the server process reads them from its
configuration: WSP rounds, the disk store, LTP rounds."""
from ..ltp import rounds as ltp_rounds


class WspSettings:
    """What a server's WSP rounds follow (docs/WSP.md): ``k`` workers per round (0: chosen from
    the measured push intervals, ``wsp.choose_k``), the staleness bound ``staleness``, the
    clock push times are read from (needed for k = 0), and ``replan_every``, the workers'
    MXPS_REPLAN_INTERVAL under live re-planning (0: none): the round before each re-plan point
    waits for every worker's own push (``wsp.before_point``)."""

    def __init__(self, k=0, staleness=2, clock=None, replan_every=0):
        if k == 0 and clock is None:
            raise ValueError("WSP with k chosen from push intervals needs a clock")
        self.k = k
        self.staleness = staleness
        self.clock = clock
        self.replan_every = int(replan_every)


class StoreSettings:
    """MXPS_STORE=disk (docs/STORE.md): where this server's tables go (``directory``), the
    RAM its caches may use (``cache_bytes``, shared out as keys arrive: a table that fits in
    an eighth of the budget is cached whole, a larger one gets what is left but an eighth),
    whether to reopen what a previous job flushed there (``resume``) and at which round
    (``resume_at``, agreed by the scheduler; None: the newest), and every how many rounds to
    checkpoint (``every``; 0: at the clean stop only)."""

    #: checkpoints each table keeps reachable (store.checkpoints: the newest common one)
    KEEP = 2

    def __init__(self, directory, cache_bytes, resume=False, every=0, resume_at=None):
        self.directory = directory
        self.cache_bytes = int(cache_bytes)
        self.resume = resume
        self.every = int(every)
        self.resume_at = resume_at if resume else None
        self.left = int(cache_bytes)

    def budget(self, table_bytes):
        """The cache of a new table of ``table_bytes`` (records and index)."""
        if table_bytes <= self.cache_bytes // 8 and table_bytes <= self.left:
            give = table_bytes
        else:
            give = max(0, self.left - self.cache_bytes // 8)
        self.left -= give
        return give

    def release(self, given):
        """A table's cache (``budget``'s answer) back: the table was removed."""
        self.left += given


class _NoShare:
    """A server state without a receiver (tests): nobody to tell who owes a round."""

    def opened(self, workers):
        pass

    def settled(self, worker):
        pass


class LtpSettings:
    """What a server's LTP rounds follow (docs/LTP.md): the filling, the acceptance ratio (0:
    adaptive), the deadline (-1: adaptive, 0: none), the grace after the last END, the packet
    payload budget, ``loss()``: each worker path's measured loss rate, ``reordered()``:
    when a packet last came out of order (``close.grace_for``; None: the grace always
    holds), ``share``: the receiver's grant (``ltp.share.Share``), told which workers
    owe an open round their push, and ``fast``: whether the receiver adds the packets that need
    nothing else into their rounds itself (``ServerState.ltp_fast``)."""

    def __init__(self, budget, fill="rescale", ratio=0.0, deadline=-1.0, grace=0.002, z=1.0,
                 floor=0.8, loss=None, reordered=None, share=None, fast=True):
        if fill not in ltp_rounds.FILLS:
            raise ValueError("unknown filling %r" % fill)
        self.budget = budget
        self.fill = fill
        self.ratio = ratio
        self.deadline = deadline
        self.grace = grace
        self.z = z
        self.floor = floor
        self.loss = loss or (lambda: None)
        self.reordered = reordered or (lambda: None)
        # the grant's account of who owes an open round its push (ltp.share.Share), or none
        self.share = share or _NoShare()
        # whether the receiver may add a packet that needs nothing else into its open round
        # itself (ServerState.ltp_fast; MXPS_LTP_FAST, for ablations)
        self.fast = fast
