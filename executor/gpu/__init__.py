"""The GPU primitives the executor and its transports build on, and nothing above them:
kernels built at run time with NVRTC (`nvrtc.py`: the loader; `copy_kernel.py`: a batch's
copies on the SMs; `quant_kernel.py`: a stage's FP8 QUANTs), prepared ops captured as one
CUDA graph (`graphs.py`), and the CUDA runtime and driver calls made on raw handles through
ctypes (`cuda_runtime.py`). No module here imports the executor's interpreter or a
transport; on a machine without a GPU each one loads and reports it has nothing to offer.
"""
