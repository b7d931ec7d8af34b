"""Builds the native CPU extension ``pagedattn._C`` with the package's own pip install.

One binary runs on every x86-64 (and aarch64): ISA-specific kernels select their
instruction set per translation unit (``#pragma GCC target``) and are chosen at run time,
so no ``-march`` flag is passed here.
"""

import glob
import os

from setuptools import setup

from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
sources = sorted(
    os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "cpu", "*.cpp"))
)

# PAGEDATTN_SANITIZE=1 (make test-sanitize): ASan + UBSan build, into its own build dir.
# -fno-wrapv undoes Python's default -fwrapv, which would hide signed overflow from UBSan.
sanitize = os.environ.get("PAGEDATTN_SANITIZE") == "1"
# -O1 after the -O3 above: ASan/UBSan at -O3 compiled for half an hour on a 2-core machine.
sanitize_flags = ["-fsanitize=address,undefined", "-fno-wrapv", "-fno-omit-frame-pointer", "-g",
                  "-O1"]

ext_modules = []
if sources:
    ext_modules.append(
        CppExtension(
            name="pagedattn._C",
            sources=sources,
            include_dirs=[os.path.join(HERE, "csrc", "cpu")],
            # -fopenmp: at::parallel_for is inlined from ATen's OpenMP backend header; without
            # it the binding TUs would silently run every op on one thread.
            extra_compile_args=["-O3", "-std=c++17", "-fno-math-errno", "-Wall", "-fopenmp",
                                "-Wno-unused-function", "-Wno-unknown-pragmas"]
            + (sanitize_flags if sanitize else []),
            extra_link_args=["-fopenmp"] + (sanitize_flags if sanitize else []),
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExtension} if ext_modules else {})
