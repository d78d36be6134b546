"""The VM lab: QEMU VMs as machines behind real BMC implementations (sushy-emulator for
Redfish, pyghmi's BMC server for IPMI), network-booting through QEMU's iPXE from a site agent.
See docs/vm-lab.md."""

from .lab import GUEST_HOST, IpmiVmBmc, LabVm, VmLab, guest_url, vm_identity
from .qemu import VirtualMachine, VmSpec, kvm_available, kvm_runs_real_mode
from .redfish import RedfishVmBmc

__all__ = [
    "GUEST_HOST",
    "IpmiVmBmc",
    "LabVm",
    "RedfishVmBmc",
    "VirtualMachine",
    "VmLab",
    "VmSpec",
    "guest_url",
    "kvm_available",
    "kvm_runs_real_mode",
    "vm_identity",
]
