"""Everything torch_xla-specific: the runtime, the mesh, several hosts, Fabric for one SPMD process, the sharding
loader, trace-once replay, the openxla bridge fix, the FSDP sharding rules and the XLA ``While`` loop."""
