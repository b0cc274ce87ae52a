"""The binding of sparkq's C core (csrc/), shared by both runtimes.

build.py compiles a build of the sources for this CPU, lib.py loads it and checks its ABI
against abi.py's ctypes mirror, session.py describes one model to it and runs prompts, decode
steps and the head. Nothing here imports torch.
"""
from .abi import ABI, SqLayer, SqLinear, SqModel
from .builds import (BUILDS, EXPECT, ISA_BUILDS, KernelUnavailable, build, cache_dir, compiler, host_builds,
                    missing_features, resolve_variant, sources)
from .lib import BUILD_SECONDS, build_name, kind_code, load, require, try_load
from .session import PREFILL_CHUNK, CLinear, Session, attn_scale, clinear, linear_struct, ptr
from .threads import Governor

__all__ = ["ABI", "SqLayer", "SqLinear", "SqModel", "BUILDS", "EXPECT", "ISA_BUILDS", "KernelUnavailable", "build",
           "cache_dir", "compiler", "host_builds", "missing_features", "resolve_variant", "sources", "BUILD_SECONDS",
           "build_name", "kind_code", "load", "require", "try_load", "PREFILL_CHUNK", "CLinear", "clinear", "Session", "attn_scale",
           "linear_struct", "ptr", "Governor"]
