"""Build retainzfs: Cython hot paths (allocator, journal codec, GIL-free I/O buffers and
checksums) plus console scripts."""
from setuptools import Extension, find_packages, setup
from Cython.Build import cythonize


def _pkg_config(flag: str, pkg: str) -> list[str]:
    """Include directories from pkg-config (libfuse installs its headers under fuse3/)."""
    import subprocess
    try:
        out = subprocess.run(["pkg-config", flag, pkg], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ["/usr/include/fuse3"]
    return [a[2:] for a in out.split() if a.startswith("-I")]


extensions = [
    Extension("retainzfs._alloc", ["retainzfs/_alloc.pyx"], extra_compile_args=["-O2"]),
    Extension("retainzfs._journal", ["retainzfs/_journal.pyx"], extra_compile_args=["-O2"]),
    Extension("retainzfs._iobuf", ["retainzfs/_iobuf.pyx"], extra_compile_args=["-O2"]),
    # libfuse 3's low-level API (libfuse3-dev): the FUSE loop, see retainzfs/_fuse.pyx
    Extension("retainzfs._fuse", ["retainzfs/_fuse.pyx"], extra_compile_args=["-O2"],
              include_dirs=_pkg_config("--cflags-only-I", "fuse3"),
              libraries=["fuse3", "pthread"]),
]

setup(
    name="retainzfs",
    version="0.1.0",
    description="FUSE filesystem that packs AI checkpoints into zones by reclaim time",
    python_requires=">=3.11",
    packages=find_packages(include=["retainzfs", "retainzfs.*"]),
    package_data={"retainzfs": ["data/mount.fuse.retainzfs"]},
    ext_modules=cythonize(extensions, language_level="3",
                          compiler_directives={"boundscheck": False, "wraparound": False}),
    install_requires=["crc32c>=2.3", "rich>=13", "tqdm>=4.60",
                      "matplotlib>=3.7",
                      "numpy>=1.24",      # replay's pattern bytes
                      "regex>=2023.0",    # .retainz regexes with a match timeout
                      "prometheus-client>=0.17",    # -o metrics=HOST:PORT
                      "xattr>=0.10"],     # user-space xattr calls (runtime, operator commands)
    extras_require={"test": ["pytest>=8", "hypothesis>=6",
                             # scripts/bench_fuse_ceiling.py's null file system on the FUSE
                             # binding retainzfs used before _fuse.pyx, and the QEMU guest's
                             # check that FUSE works there
                             "pyfuse3>=3.3", "trio>=0.22",
                             # tests/test_frameworks.py: the real framework packages
                             "lightning>=2.2", "transformers>=4.46", "accelerate>=0.26",
                             "safetensors>=0.4",
                             # tests/test_frameworks_real.py, tests/test_two_node.py: none of
                             # them pins torch, so they install beside torch 2.13 (CPU)
                             "torchtitan==0.3.0", "nvidia-resiliency-ext==0.4.1",
                             "megatron-core==0.16.1"]},
    entry_points={
        "console_scripts": [
            "mkfs.retainzfs=retainzfs.cli.mkfs:main",
            "mount.retainzfs=retainzfs.cli.mount:main",
            "retainzfs=retainzfs.cli.main:main",
        ]
    },
)
