"""Where each slice of each key lives: pure functions and small classes, no sockets.

``plan`` (versioned tables key -> slices (server, offset, length); MXNet's own rule and the
proportional rule), ``adaptive`` (bandwidth-proportional splits, the live re-plan decision),
``metrics`` (per-step metrics and the workers' bandwidth estimate).
"""
