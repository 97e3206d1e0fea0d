"""Builds the reference engine's optional C kernel; all other metadata is in pyproject.toml.

``optional=True``: where there is no C compiler (or no Python headers) the build skips
the extension with a warning and the engine runs its NumPy path.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "service.engines.reference.native._kernels",
            ["service/engines/reference/native/kernels.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
