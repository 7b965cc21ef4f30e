"""The host beside the model: how vserve's processes use the machine's CPUs, threads and heap,
and how they live and die together.

| file                   | owns                                                            |
|------------------------|-----------------------------------------------------------------|
| `policy.py`            | `HostPolicy`: every such decision, made once from the device,   |
|                        | the engine's config and the environment                         |
| `placement.py`         | the plan: which cores the workers and the host processes get    |
| `placement_control.py` | the controller that measures host work and re-plans             |
| `affinity.py`          | pinning processes and threads, CPU time, yielding at wake-up    |
| `heap.py`              | the C heap's policy: keep freed pages while stepping, trim idle |
| `lifeline.py`          | a process that ends with its parent                             |
| `proc_tree.py`         | a process's descendants (from /proc)                            |
| `isa.py`               | the instruction sets the CPU kernels target (`VSERVE_CPU_ISA`)  |
"""
