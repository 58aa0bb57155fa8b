"""Builds recshard's CPU embedding kernel (recshard/lookup/csrc/cpu_tbe.cpp) at install.

Plain C++ with no torch headers (about two seconds to compile); the metadata is in
pyproject.toml. `recshard.lookup.native_tbe` falls back to fbgemm if the build is missing.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "recshard.lookup._cpu_tbe",
            sources=["recshard/lookup/csrc/cpu_tbe.cpp"],
            extra_compile_args=["-O3", "-std=c++17"],
            language="c++",
            optional=True,  # a machine without a C++ compiler still installs (fbgemm runs)
        )
    ]
)
