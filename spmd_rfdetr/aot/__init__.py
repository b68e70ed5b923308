"""Ahead-of-time TPU compile check: torch_xla's HLO compiled for a real TPU topology by libtpu on a CPU-only host.

``python -m spmd_rfdetr aot --config configs/v5e.yaml --topology v5e:2x4 [--json report.json] [--max-batch]``
(:mod:`.check`): nothing is compiled for the CPU or run. Per program it prints whether it fits, HBM per chip, FLOPs and
bytes accessed per step (the compiler's count, which includes on-chip memory, and its HBM part), a roofline time per
step from the chip's published peak and bandwidth (:mod:`.chips`), the collectives in the program and inside loops,
and compile time, then the bytes by model component (:mod:`.components`); ``--json`` adds memory by kind, the largest
byte movers and the source lines (rfdetr's or ours) of every collective. ``--max-batch`` searches
``data.per_device_batch_size`` for the largest that compiles and the largest that leaves ``--headroom`` (10%) of HBM
free. ``--hbm_only true`` compiles with no buffer in on-chip memory (:attr:`.chips.Chip.hbm_only_flag`), so that the
bytes accessed are HBM traffic only: the compiler's upper bound on the real program's.

Topologies: ``v5e:1x1`` (Colab/Kaggle v5e-1), ``v5e:2x2``, ``v5e:2x4`` (v5litepod-8), ``v6e:2x4``, ``v4:2x2x1``,
``v5p:2x2x1``, ``v3:2x2`` (Kaggle's v3-8), or a Cloud name such as ``v5litepod-8``. The ``aot`` extra pins the libtpu
that torch_xla 2.9's ``tpu`` extra runs, so it is the compiler a TPU VM uses. A compile of a shipped recipe needs
10.7-19.7 GB of RAM and 3-30 minutes on 2 cores (per recipe: ``benchmarks/README.md``).
"""
