"""Where a lost server's slices go (MXPS_FAILOVER, docs/FAILOVER.md).

Every worker computes the successor table from the table in force and the lost servers alone,
so all of them agree without exchanging it: each slice of a lost server goes, whole and in
place (same offset and length, so a request to the lost server maps to exactly one request to
its successor), to the surviving server with the fewest elements so far, the lowest rank on a
tie; slices are taken in key and offset order.  The surviving servers' slices do not move.
"""
import dataclasses


def buddy(server, lost, num_servers):
    """The next server after ``server`` in rank order (cyclic) that is not lost: where
    ``server`` keeps its optimizer state with MXPS_REPLICA (``roles.replica``)."""
    for i in range(1, num_servers):
        r = (server + i) % num_servers
        if r not in lost:
            return r
    raise ValueError("no server survives: servers %s are lost" % sorted(lost))


def successors(table, lost, num_servers, buddies=False):
    """(the table with every slice of a server in ``lost`` on a survivor, {(key, offset):
    successor} for the slices that moved).  With ``buddies`` (MXPS_REPLICA) a lost slice goes
    to the lost server's buddy, which holds its optimizer state."""
    alive = [s for s in range(num_servers) if s not in lost]
    if not alive:
        raise ValueError("no server survives: servers %s are lost" % sorted(lost))
    load = {s: 0 for s in alive}
    for slices in table.values():
        for x in slices:
            if x.server in load:
                load[x.server] += x.length
    new, moved = {}, {}
    for key in sorted(table):
        out = []
        for x in table[key]:
            if x.server in lost:
                if buddies:
                    to = buddy(x.server, lost, num_servers)
                else:
                    to = min(alive, key=lambda s: (load[s], s))
                load[to] += x.length
                moved[(key, x.offset)] = to
                x = dataclasses.replace(x, server=to)
            out.append(x)
        new[key] = tuple(out)
    return new, moved
