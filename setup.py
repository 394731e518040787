"""Only the optional C extension lives here; everything else is in pyproject.toml.

`protocol._fasthash` needs xxhash.h (Debian: libxxhash-dev, which `make install` adds as root).
Without it the build skips the extension and protocol.hashing runs its pure-Python version.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("protocol._fasthash", sources=["protocol/_fasthash.c"], optional=True, extra_compile_args=["-O3"]),
    ]
)
