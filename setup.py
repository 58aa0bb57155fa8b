"""Builds recshard's C++ libraries at install: the CPU embedding kernel (csrc/cpu_tbe.cpp),
the key_value tables' row I/O (csrc/row_io.cpp) and their row cache's bookkeeping
(csrc/row_cache.cpp), managed collision's id index, remap, routing and history record
(recshard/distributed/csrc/mc_index.cpp, mc_draw.cpp, mc_route.cpp, mc_record.cpp), DLRM's
pairwise interaction (recshard/models/csrc/interaction.cpp).

Plain C++ with no torch headers (seconds to compile); the metadata is in pyproject.toml.
All are optional: `recshard.lookup.native_tbe` falls back to fbgemm,
`recshard.lookup.native_row_io` to Python's os.pread/os.pwrite,
`recshard.lookup.native_row_cache`, `recshard.distributed.mc_native` and
`recshard.models.interaction` to torch ops if a build is missing.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "recshard.lookup._cpu_tbe",
            sources=["recshard/lookup/csrc/cpu_tbe.cpp"],
            # no fused multiply-adds but the code's own: the same bytes as torch's kernel
            extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off"],
            language="c++",
            optional=True,  # a machine without a C++ compiler still installs (fbgemm runs)
        ),
        Extension(
            "recshard.lookup._row_io",
            sources=["recshard/lookup/csrc/row_io.cpp"],
            extra_compile_args=["-O2", "-std=c++17"],
            language="c++",
            optional=True,  # without it, row I/O runs from Python
        ),
        Extension(
            "recshard.lookup._row_cache",
            sources=["recshard/lookup/csrc/row_cache.cpp"],
            extra_compile_args=["-O2", "-std=c++17"],
            language="c++",
            optional=True,  # without it, the cache's bookkeeping runs in torch
        ),
        Extension(
            "recshard.distributed._mc_index",
            sources=[
                "recshard/distributed/csrc/mc_index.cpp",
                "recshard/distributed/csrc/mc_draw.cpp",
                "recshard/distributed/csrc/mc_route.cpp",
                "recshard/distributed/csrc/mc_record.cpp",
            ],
            depends=[
                "recshard/distributed/csrc/mc_codes.h",
                "recshard/distributed/csrc/mc_bucket.h",
                "recshard/distributed/csrc/mc_contest.h",
                "recshard/distributed/csrc/mc_segments.h",
            ],
            # no fused multiply-add: a reset's numbers equal their torch twin's bit for bit
            extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off"],
            language="c++",
            optional=True,  # without it, managed collision remaps with torch ops
        ),
        Extension(
            "recshard.models._interaction",
            sources=["recshard/models/csrc/interaction.cpp"],
            extra_compile_args=["-O3", "-std=c++17", "-pthread"],
            extra_link_args=["-pthread"],
            language="c++",
            optional=True,  # without it, DLRM's interaction runs torch.bmm
        ),
    ]
)
