"""autopp: automatic pipeline-parallelism planning for PyTorch."""
