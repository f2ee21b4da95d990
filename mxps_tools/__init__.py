"""mxps's tools: the ``mxps`` and ``mxps-patch`` commands, the benchmark and its training job,
the emulated network, the job runner, plots and MXNet's patch files.

Never imported by a training process, and importing a tool starts no role and imports no MXNet:
a tool reaches the runtime only through ``mxps_tools.runtime`` inside the commands that need it.
"""
