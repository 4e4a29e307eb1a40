# Device probe only: the runtime tests on the device's CPUs.
import os
import sys

if os.environ.get("K3_PROBE_STANDINS"):
    sys.path.insert(0, os.environ["K3_PROBE_REPO"])
    from tests.gpu import standins

    standins.install()
    import vllm.third_party.pynvml as pynvml

    def _no_nvml(*args, **kwargs):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    pynvml.nvmlInit = _no_nvml
