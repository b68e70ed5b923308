"""The suite's XLA settings, set by conftest before torch_xla starts (constants only: importing this sets nothing)."""

#: XLA's CPU code generator without LLVM optimisation, for this process and every subprocess it starts. Measured on
#: the tiny step (configs/cpu.yaml, 8 steps, this 2-core machine, 2026-12-01): the first step (trace + compile) 47-62 s
#: instead of 128-135 s, each later step 4.8 s instead of 2.6 s; the suite compiles far more than it steps. The
#: HLO handed to XLA is the same; reductions round differently (1 ulp at step 1), so every run a test compares bit for
#: bit with another (replay/trace, resume/straight) runs with the same flags, and parity bounds are unchanged.
#: And one thread per process, in XLA's programs (no multi-threaded Eigen) and in torch's eager ops (OMP): the suite
#: runs two processes at once on 2 cores (``jobs.py``). Measured 2026-12-02, two README-script fits side by side:
#: 152 s each instead of 178 s, the same CPU time; the SciPy sweep beside a busy core 136 s instead of 168 s.
CPU_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_multi_thread_eigen=false"


#: torch_xla keeps every compiled program in an LRU cache of 2048 by default: a process running this whole suite
#: then holds dozens of RF-DETR programs (~0.5 GB each on the CPU backend) beside an 8-device ``fit`` subprocess
#: (~12 GB), more than a 24 GB machine has. The bound is this process's own: a subprocess (a ``fit`` in openxla mode,
#: upstream's eager step on XLA) runs more distinct graphs per step than this and would recompile them every step.
COMPILATION_CACHE_SIZE = 12
