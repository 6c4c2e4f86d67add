"""CpuAcc and GpuAcc: adaptation layers over PyTorch's kernels (as Arm NN's CpuAcc / GpuAcc adapt
ComputeLibrary). Importing this package does not import torch; creating a backend does, and a missing
torch (or CUDA) makes the backend report itself unavailable with the reason."""
