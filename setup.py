"""Build and install mxps: the Python package plus the Cython hot paths in cython/."""
import os

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _read_version():
    ns = {}
    with open(os.path.join(HERE, "mxps", "_version.py")) as f:
        exec(f.read(), ns)
    return ns["__version__"]


EXTENSIONS = [
    # Summing worker slices into an accumulator without the GIL (server hot path).
    Extension("mxps.kernels._accum", ["cython/accum.pyx"], extra_compile_args=["-O3"]),
    # Asynchronous operations on MXNet's dependency engine (worker overlap).
    Extension("mxps.kernels._engine", ["cython/engine.pyx"], extra_compile_args=["-O2"]),
    # LTP's batched UDP I/O: recvmmsg / sendmmsg (server and worker hot paths, MXPS_PUSH=ltp).
    Extension("mxps.kernels._ltp", ["cython/ltp.pyx"], extra_compile_args=["-O2"]),
    # Gradient compression's 2bit / 1bit quantizers (worker pushes, server intake).
    Extension("mxps.kernels._quantize", ["cython/quantize.pyx"], extra_compile_args=["-O2"]),
]

EXAMPLES = ["scikit-learn<1.8", "scipy<1.16", "gluoncv==0.10.5.post0", "pandas<3",
            "opencv-python<4.12", "matplotlib<3.11", "tqdm"]

setup(
    name="mxps",
    version=_read_version(),
    description="A bandwidth-aware parameter server plugin for Apache MXNet (kvstore='mxps')",
    long_description=open(os.path.join(HERE, "README.md")).read()
    if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    # mxnet 1.9.1's wheels and this project's CI: CPython 3.11
    python_requires=">=3.11",
    # mxps: the runtime (what a training process imports); mxps_tools: bench, emulated
    # network, job runner, plots, patches, CLI (never imported by a training process)
    packages=find_packages(include=["mxps", "mxps.*", "mxps_tools", "mxps_tools.*"])
    + ["mxps_tools._patches"],
    package_dir={"mxps_tools._patches": "patches"},
    package_data={"mxps_tools._patches": ["*.patch", "README.md"],
                  # the simulator's zoo, calibration and validation data (mxps simulate)
                  "mxps_tools.simulate": ["*.json"]},
    ext_modules=cythonize(EXTENSIONS, compiler_directives={"language_level": "3"}),
    install_requires=[
        # mxps patches and drives MXNet 1.9.1 internals: exactly this version.
        "mxnet==1.9.1",
        # mxnet 1.9.1 uses np.bool and friends, removed in numpy 1.24.
        "numpy>=1.17,<1.24",
        "pyzmq>=22",
        # the data plane's AES-256-GCM and HKDF with a job secret (mxps.wire.seal): OpenSSL
        "cryptography>=46",
        # the tools: process CPU and sockets of jobs (mxps_tools.jobs), the bench's tables
        "psutil>=5.9",
        "tabulate>=0.9",
        # mxps simulate's discrete-event engine (SimPy 4, not Debian's SimPy 2)
        "simpy>=4,<5",
    ],
    extras_require={
        # the main job (digits example) and the benchmark.  The upper bounds are the last
        # releases that still run on numpy<1.24 (directly, or through gluoncv for pandas and
        # opencv-python): without them pip downloads every newer release (~500 MB) only to
        # reject it for its numpy requirement.
        "examples": EXAMPLES,
        "test": ["pytest", "hypothesis"] + EXAMPLES,
    },
    entry_points={
        "console_scripts": [
            "mxps=mxps_tools.cli:main",
            "mxps-patch=mxps_tools.patching:main",
        ],
    },
    zip_safe=False,
)
