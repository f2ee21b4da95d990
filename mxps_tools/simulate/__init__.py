"""``mxps simulate``: a discrete-event model of a synchronous parameter-server step (SimPy 4),
placement and re-planning by the runtime's own code, validated against ``mxps bench``
(docs/SIMULATE.md).

Layers, each importing only those below it: ``fluid`` (max-min fair links on SimPy),
``models`` (key sizes), ``calibration`` (measured parameters), ``systems`` (placement and
sending per system, ``mxps.placement``), ``job`` (the step), ``scenarios`` (the bench's
vocabulary), ``run`` (a summary in the bench's shape), ``validate``, ``predictions``,
``calibrate``, ``cli``.
"""
