"""OR-Tools CP-SAT models: the split on heterogeneous devices, device placement, schedule synthesis and its warm
starts."""
