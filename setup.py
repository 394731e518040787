"""Only the optional C extensions live here; everything else is in pyproject.toml.

`protocol._fasthash` needs xxhash.h (Debian: libxxhash-dev, which `make install` adds as root).
Without it the build skips the extension and protocol.hashing runs its pure-Python version.
`router._blockindex` needs only a C compiler; without one router.block_index runs in pure Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("protocol._fasthash", sources=["protocol/_fasthash.c"], optional=True, extra_compile_args=["-O3"]),
        Extension("router._blockindex", sources=["router/_blockindex.c"], optional=True, extra_compile_args=["-O3"]),
    ]
)
