"""How much memory the device has and who uses it: NVML on CUDA, psutil on the CPU."""


class MemoryProbe:
    """Device totals: NVML on CUDA (other processes included), system RAM (psutil) on the CPU."""

    def __init__(self, device):
        self.device = device
        self._nvml = nvml_handle(device) if device.type == "cuda" else None

    def totals(self) -> tuple[int, int]:
        """(total bytes, bytes in use by everything, this process included)."""
        if self.device.type == "cuda":
            if self._nvml is not None:
                import pynvml

                info = pynvml.nvmlDeviceGetMemoryInfo(self._nvml)
                return info.total, info.used
            import torch

            free, total = torch.cuda.mem_get_info(self.device)
            return total, total - free
        import psutil

        vm = psutil.virtual_memory()
        return vm.total, vm.total - vm.available

    def own(self) -> int:
        """Bytes this process holds on the device. On CUDA, NVML's count for this process when it
        lists it: torch's reserved bytes miss the CUDA context and the loaded kernels (hundreds of
        MiB), which would otherwise pass for another program's."""
        if self.device.type == "cuda":
            import torch

            listed = self._nvml_own()
            return listed if listed is not None else torch.cuda.memory_reserved(self.device)
        import psutil

        return psutil.Process().memory_info().rss

    def _nvml_own(self) -> int | None:
        if self._nvml is None:
            return None
        import os

        import pynvml

        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml)
        except pynvml.NVMLError:
            return None
        mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory]
        return mine[0] if mine else None  # in a container NVML may list host pids


def nvml_handle(device):
    """NVML's handle for a torch CUDA device, found by UUID: NVML's indices ignore
    CUDA_VISIBLE_DEVICES and MIG, so index 0 may be another GPU. None: torch's view is used."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # no driver library, no pynvml
        return None
    for name in (uuid, "GPU-" + uuid, "MIG-" + uuid):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name)
        except Exception:
            continue
    return None


class ScriptedProbe:
    """A probe that reports what a test tells it: total, and what other processes use."""

    def __init__(self, total: int, other: int = 0, own: int = 0):
        self.total, self.other, self._own = total, other, own

    def totals(self) -> tuple[int, int]:
        return self.total, self.other + self._own

    def own(self) -> int:
        return self._own
