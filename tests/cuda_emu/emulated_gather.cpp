// csrc/cuda/gather_cuda.cu, compiled by the host compiler against the emulation (build.py).
#include "../../csrc/cuda/gather_cuda.cu"
