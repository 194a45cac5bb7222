"""`ninfer bench`: speed of the public Engine beside the package's roofline, measured in the same run.

- `roofline`: bytes one decode step must read and FLOPs a prefill must do, from the package's dims;
- `probes`: memory bandwidth and matmul throughput of the device;
- `startup`: the Engine under test, from an artifact or with synthetic weights, start-up timed;
- `drive`: the requests and the clocks (a unit observer on the Engine, caller-side event times);
- `report` / `runner`: the result, as a table or JSON, and the whole run.
"""
