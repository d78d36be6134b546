"""The simulated fleet (``MetalSim``): machines behind one real Redfish endpoint that boot real
bcd processes, with fault knobs and a ledger counted at the hardware. See docs/metal-sim.md."""

from .driving import SiteDriver
from .fleet import MetalSim
from .gate import TcpGate
from .hardware import FaultFractions, Faults, Ledger, SimMachine
from .stack import FleetStack, fleet_stack

__all__ = [
    "FaultFractions",
    "Faults",
    "FleetStack",
    "Ledger",
    "MetalSim",
    "SimMachine",
    "SiteDriver",
    "TcpGate",
    "fleet_stack",
]
