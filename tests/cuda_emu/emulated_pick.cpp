// csrc/cuda/pick_cuda.cu, compiled by the host compiler against the emulation (build.py).
#include "../../csrc/cuda/pick_cuda.cu"
