"""CPU runs: keep freed memory in the process instead of handing it back to the kernel after every step.

PyTorch allocates CPU tensors with the C library's ``malloc``. glibc serves large blocks (the activations of a
forward and backward) from fresh ``mmap`` regions or from the top of the heap, and returns them to the kernel when
they are freed (``munmap``, heap trimming); the next step allocates them again and takes one page fault per 4 KiB
page it touches. On a ResNet-20 transfer attack (64 CIFAR-10 images, 10 steps) that is about 130,000 page faults
per run. :func:`keep_freed_memory` serves every block below 32 MiB from the heap and never trims it
(``M_MMAP_THRESHOLD`` 32 MiB, glibc's largest on 64-bit; ``M_TRIM_THRESHOLD`` 2^31 - 1), so the heap grows to the
run's peak once and is reused: about 10x fewer faults. It changes no result, only where freed memory goes; the peak
resident size grows by 5-20 %. Its effect on wall time ranges from none measurable (whole runs on an idle 2-core
machine) to 20-28 % less (a loaded machine; the transfer timing script): ``benchmarks/RESULTS.md``, "Page faults".

Blocks of 32 MiB and more (a step's probe batch at ImageNet size, HSJA's bounded probe calls) are still mapped
and unmapped: kept in the heap, blocks of changing large sizes fragmented it (Sign-OPT at 64 slots of 299 x 299
images held 7.4 GB with every block kept, 3.9 GB with the threshold; on CIFAR-10 the faults and wall times of
transfer, NES and HSJA runs stay those of keeping everything: ``benchmarks/RESULTS.md``, "Memory at ImageNet
size"). Where glibc refuses the threshold (a 32-bit build), no block is mapped, as before.

``blackboxbench run`` applies it at start (``--malloc default`` leaves glibc as it is). It is process-wide, so a
library user calls it explicitly or not at all; on another C library (macOS, musl, Windows) it does nothing. GPU
tensors do not use ``malloc`` (PyTorch's CUDA caching allocator already keeps its blocks).
"""
import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 2 ** 31 - 1   # never trim the heap top (mallopt takes an int)
MMAP_THRESHOLD = 32 * 2 ** 20  # blocks from here up are mapped (glibc's largest threshold on 64-bit)


def is_glibc():
    """Whether this process runs on Linux with glibc (the only C library :func:`keep_freed_memory` knows)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory():
    """glibc only: blocks below ``MMAP_THRESHOLD`` from the heap, no heap trimming, process-wide. Returns whether
    it applied."""
    if not is_glibc():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mapped = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) or bool(mallopt(M_MMAP_MAX, 0))
    return mapped and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
